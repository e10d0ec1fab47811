"""Host agents: two launchers (two host ids) of two ranks each in front of one coordinator.

The ranks' coordinator calls go through their launcher (client/host_agent.py); the coordinator's own call
counters show one heartbeat caller per host, and both failure paths (a rank killed, a launcher killed) end
with the right rank or host named.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _world import listening_port

from paramplane.coordinator.metrics import metrics_text
from paramplane.node.coord_client import CoordinatorClient, ask_coordinator
from paramplane.node.errors import CoordinatorUnavailable
from paramplane.protos import coordinator_pb2 as pb

WORKER = Path(__file__).resolve().parents[1] / "workers" / "agent_world.py"
TOKEN = "agent-test-token"
HOSTS = ("hostA", "hostB")


def _status(address: str) -> pb.StatusResponse:
    async def call(client: CoordinatorClient) -> pb.StatusResponse:
        return await client.status()

    return ask_coordinator(address, TOKEN, call, timeout_s=10.0)


def _wait_status(address: str, ok: object, what: str, timeout_s: float = 90.0) -> pb.StatusResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status: pb.StatusResponse | None = _status(address)
        except CoordinatorUnavailable:  # a handshake that timed out on the loaded machine: ask again
            status = None
        if status is not None and ok(status):  # type: ignore[operator]
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen within {timeout_s} s: {status}")
        time.sleep(0.1)


@contextmanager
def _job(
    folder: Path, mode: str, heartbeat_timeout_s: float
) -> Iterator[tuple[str, list[subprocess.Popen[str]]]]:
    """A coordinator process (world of 4) and one launcher per host running the worker; all of it ends."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARAMPLANE_")}
    env["PARAMPLANE_TOKEN"] = TOKEN
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "paramplane.coordinator", "--port", "0", "--world-size", "4",
         "--heartbeat-timeout", str(heartbeat_timeout_s)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    launchers: list[subprocess.Popen[str]] = []
    rank_pids: set[int] = set()
    address = ""
    try:
        address = f"127.0.0.1:{listening_port(coordinator, time.monotonic() + 30)}"
        launchers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "paramplane.cli",
                    "launch",
                    "-n",
                    "2",
                    "--coordinator",
                    address,
                    "--world-size",
                    "4",
                    "--host-id",
                    host,
                    "--timeout",
                    "30",
                    "--grace",
                    "1",
                    str(WORKER),
                    str(folder),
                    mode,
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for host in HOSTS
        ]
        yield address, launchers
    finally:
        with contextlib.suppress(Exception):
            if address:
                rank_pids = {r.pid for r in _status(address).ranks}
        for p in launchers:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for pid in rank_pids:  # ranks a killed launcher left behind (their own sessions)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        coordinator.kill()
        coordinator.wait(10)


def _all_beat(status: pb.StatusResponse) -> bool:
    return status.formed and len(status.ranks) == 4 and all(r.since_heartbeat_s >= 0 for r in status.ranks)


@pytest.mark.timeout(240)
def test_agents_join_and_train_with_one_heartbeat_caller_per_host(tmp_path: Path) -> None:
    with _job(tmp_path, "finish", 10.0) as (address, launchers):
        status = _wait_status(address, _all_beat, "every rank's heartbeat")
        calls = dict(status.num_calls)
        assert status.num_heartbeat_callers == 2, status.num_heartbeat_callers
        assert all(r.agent == r.host_id for r in status.ranks), status.ranks
        assert sorted(r.agent for r in status.ranks) == ["hostA", "hostA", "hostB", "hostB"], status.ranks
        assert calls.get("Heartbeat", 0) == 0 and calls["HeartbeatHost"] >= 2, calls
        # One host join per host, or more when a host's ranks started further apart than the agent's join window.
        assert calls.get("Join", 0) == 0 and 2 <= calls["JoinHost"] <= 4, calls
        assert calls["Watch"] == 2, calls  # one stream per host, not per rank
        metrics = metrics_text(status).decode()  # what /metrics serves
        assert "paramplane_heartbeat_callers 2.0" in metrics, metrics
        assert 'paramplane_coordinator_calls_total{method="HeartbeatHost"}' in metrics, metrics
        (tmp_path / "finish").touch()
        outputs = [p.communicate(timeout=120)[0] for p in launchers]
    for p, out in zip(launchers, outputs):
        assert p.returncode == 0, out[-3000:]
        assert out.count("trained rank=") == 2, out[-3000:]


@pytest.mark.timeout(240)
def test_a_killed_rank_is_named_lost(tmp_path: Path) -> None:
    """Its agent reports it at once (the launcher saw its child killed); should that report not come first, the
    coordinator's heartbeat timeout names it. Either way the survivors fail naming rank 3."""
    with _job(tmp_path, "kill3", 10.0) as (address, launchers):
        outputs = [p.communicate(timeout=120)[0] for p in launchers]
        status = _wait_status(address, lambda s: s.aborted, "the abort", timeout_s=60.0)
    assert status.abort_rank == 3, (status.abort_rank, status.abort_reason, outputs)
    assert (
        "rank 3 (pid" in status.abort_reason
        and "was killed by SIGKILL: its launcher saw the process end" in status.abort_reason
    ) or status.abort_reason.startswith("rank 3 missed heartbeats"), (status.abort_reason, outputs)
    # The survivors hear of it from the coordinator or from their links to rank 3; the first to fail on a host
    # ends its launcher, which stops the other. (A survivor on the other host may instead see its link to rank
    # 3's host-mate drop first, that rank having exited on rank 3's death: the data plane names that rank.)
    failures = [line for out in outputs for line in out.splitlines() if "] failed " in line]
    assert any("rank=3:" in line for line in failures), outputs
    assert all(p.returncode != 0 for p in launchers)


@pytest.mark.timeout(240)
def test_a_killed_launcher_gets_its_hosts_ranks_named_lost(tmp_path: Path) -> None:
    with _job(tmp_path, "run", 3.0) as (address, launchers):
        before = _wait_status(address, _all_beat, "every rank's heartbeat")
        lost = sorted(r.rank for r in before.ranks if r.host_id == "hostB")
        launchers[1].kill()  # hostB's agent; its ranks live on in their own sessions, cut off
        launchers[1].wait(10)
        status = _wait_status(address, lambda s: s.aborted, "the abort", timeout_s=60.0)
        launchers[0].communicate(timeout=120)
    assert status.abort_rank in lost, (status.abort_rank, status.abort_reason)
    assert f"host agent hostB (ranks {lost}" in status.abort_reason, status.abort_reason
