"""A coordinator that dies without a word: ranks fail with CoordinatorUnavailable within the heartbeat timeout."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from _world import listening_port

WORKER = Path(__file__).resolve().parents[1] / "workers" / "lost_coordinator.py"


def test_ranks_fail_typed_when_the_coordinator_is_killed(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMPLANE_")}
    coordinator = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paramplane.coordinator",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--world-size",
            "2",
            "--heartbeat-timeout",
            "2",
            "--heartbeat-interval",
            "0.2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        port = listening_port(coordinator, time.monotonic() + 30)
        for r in range(2):
            rank_env = dict(
                env,
                PARAMPLANE_COORDINATOR=f"127.0.0.1:{port}",
                PARAMPLANE_RANK=str(r),
                PARAMPLANE_WORLD_SIZE="2",
                PARAMPLANE_TEST_OUT=str(tmp_path),
                PYTHONUNBUFFERED="1",
            )
            ranks.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER)],
                    env=rank_env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        for p in ranks:  # both ranks formed a world and ran a collective
            assert p.stdout is not None
            ready, _, _ = select.select([p.stdout], [], [], 60)
            assert ready and p.stdout.readline().strip() == b"ready"
        killed_at = time.time()
        os.killpg(coordinator.pid, signal.SIGKILL)
        for p in ranks:
            p.communicate(timeout=90)
    finally:
        for p in [*ranks, coordinator]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    # The first rank to notice names the coordinator; a rank still inside a collective when that one exits may
    # see its peer go first (PeerLost), which is also a typed failure within the bound.
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert all(result["failures"] == [] for result in reports), reports
    errors = [result["values"]["error"] for result in reports]
    assert "CoordinatorUnavailable" in errors and set(errors) <= {"CoordinatorUnavailable", "PeerLost"}, (
        reports
    )
    for values in (result["values"] for result in reports):
        if values["error"] == "CoordinatorUnavailable":
            assert "has not answered" in values["message"] and f"127.0.0.1:{port}" in values["message"], (
                values
            )
        assert values["at"] - killed_at < 2 + 15, (
            values
        )  # the heartbeat timeout, with slack for a busy machine
