"""A reusable multi-process world for data-plane tests.

``run_world(n, target)`` starts a coordinator (127.0.0.1, port 0) in this
process, spawns ``n`` rank processes running ``target`` (a script path or a
``-m`` module name) with the PARAMPLANE_* variables set, waits for them all,
kills only its own processes (by PID) when the deadline passes, and stops the
coordinator. Ranks report through JSON files: a worker writes
``$PARAMPLANE_TEST_OUT/rank-<r>.json`` (see ``tests/workers/_common.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "paramplane-"


@dataclass
class RankOutcome:
    """What one rank process left behind."""

    rank: int
    """The rank index the harness launched it as (PARAMPLANE_RANK)."""
    returncode: int | None
    """Exit status (negative: killed by that signal, e.g. -9 by the harness after the deadline)."""
    output: str
    """stdout and stderr together."""
    result: dict[str, Any] | None
    """The JSON the worker wrote, or None if it wrote none."""


@dataclass
class WorldOutcome:
    """Every rank's outcome and whether the harness had to kill anyone."""

    ranks: list[RankOutcome] = field(default_factory=list)
    """Outcomes in rank order."""
    timed_out: bool = False
    """True when the deadline passed and remaining ranks were killed."""
    replaced: list[RankOutcome] = field(default_factory=list)
    """The first processes of ranks that were replaced (``run_world(replace=...)``); ``ranks`` holds
    their replacements."""

    def describe(self) -> str:
        parts = []
        for r in self.replaced:
            parts.append(f"--- rank {r.rank} (replaced) exit {r.returncode} ---\n{r.output[-6000:]}")
        for r in self.ranks:
            parts.append(f"--- rank {r.rank} exit {r.returncode} ---\n{r.output[-6000:]}")
        return ("TIMED OUT\n" if self.timed_out else "") + "\n".join(parts)

    def shm_leaks(self) -> set[str]:
        """/dev/shm entries left by this world's job (segment names carry the job id's prefix)."""
        jobs = {
            r.result["values"]["job_id"][:12]
            for r in self.ranks
            if r.result and "job_id" in r.result["values"]
        }
        assert jobs, "no rank reported its job id"
        return {name for name in shm_entries() if any(name.startswith(f"{SHM_PREFIX}{job}") for job in jobs)}

    def check_ok(self, min_checks: int = 0) -> list[dict[str, Any]]:
        """Assert every rank exited 0, ran at least ``min_checks`` checks and none failed; returns the results
        in rank order."""
        assert not self.timed_out, self.describe()
        assert all(r.returncode == 0 for r in self.ranks), self.describe()
        results = []
        for r in self.ranks:
            assert r.result is not None, f"rank {r.rank} wrote no result\n{self.describe()}"
            assert r.result.get("failures") == [], (
                f"rank {r.rank}: {r.result.get('failures')}\n{self.describe()}"
            )
            assert r.result.get("num_checks", 0) >= min_checks, (
                f"rank {r.rank} ran {r.result.get('num_checks')} checks, expected at least {min_checks}\n"
                f"{self.describe()}"
            )
            results.append(r.result)
        return results


def shm_entries() -> set[str]:
    """The paramplane segments currently in /dev/shm."""
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIX)}


def _command(target: str, args: Sequence[str]) -> list[str]:
    path = Path(target)
    if target.endswith(".py"):
        if not path.is_absolute():
            path = WORKERS / path if (WORKERS / path).exists() else REPO / path
        return [sys.executable, str(path), *args]
    return [sys.executable, "-m", target, *args]


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` (ours, by PID; its own session so nothing else is touched) and reap it."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def run_world(
    n: int,
    target: str,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    timeout: float = 60.0,
    heartbeat_timeout_s: float = 10.0,
    heartbeat_interval_s: float = 0.5,
    progress_timeout_s: float | None = None,
    token: str | None = None,
    out_dir: str | os.PathLike[str] | None = None,
    replace: Mapping[int, Mapping[str, str]] | None = None,
) -> WorldOutcome:
    """Run ``target`` as ranks 0..n-1 of one world and collect what each left behind.

    ``env`` is added to every rank's environment, ``rank_env[r]`` to rank r's only. The ranks
    get PARAMPLANE_COORDINATOR, _RANK, _WORLD_SIZE, _TOKEN (when ``token`` is given) and
    PARAMPLANE_TEST_OUT (the folder for their JSON results). After ``timeout`` seconds the
    ranks still running are killed and ``timed_out`` is set. For each rank in ``replace``, once its
    process has exited a replacement process starts as the same rank with PARAMPLANE_REPLACEMENT=1
    and ``replace[rank]`` added to its environment (the survivors' ``World.reform()`` admits it).
    """
    if n < 1:
        raise ValueError(f"a world needs at least one rank, got {n}")
    config = CoordinatorConfig(
        host="127.0.0.1",
        port=0,
        world_size=n,
        token=token,
        join_timeout_s=max(10.0, timeout),
        heartbeat_interval_s=heartbeat_interval_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )
    if progress_timeout_s is not None:
        config = dataclasses.replace(config, progress_timeout_s=progress_timeout_s)
    coordinator = CoordinatorThread(config)
    address = coordinator.start()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Any] = []
    outcome = WorldOutcome()
    first_of: dict[int, tuple[subprocess.Popen[bytes], Any]] = {}  # replaced rank -> its first process, log
    with tempfile.TemporaryDirectory(prefix="pp-world-") as scratch:
        results = Path(out_dir) if out_dir is not None else Path(scratch)
        try:

            def spawn(rank: int, extra: Mapping[str, str], label: str) -> subprocess.Popen[bytes]:
                child_env = dict(os.environ)
                child_env.update(
                    PARAMPLANE_COORDINATOR=address,
                    PARAMPLANE_RANK=str(rank),
                    PARAMPLANE_WORLD_SIZE=str(n),
                    PARAMPLANE_TEST_OUT=str(results),
                    PARAMPLANE_JOIN_TIMEOUT=str(max(10.0, timeout)),
                    PYTHONUNBUFFERED="1",
                )
                if token is not None:
                    child_env["PARAMPLANE_TOKEN"] = token
                child_env.update(env or {})
                child_env.update(extra)
                log = open(Path(scratch) / f"log-{label}.txt", "w+b")  # noqa: SIM115 (closed below)
                logs.append(log)
                return subprocess.Popen(
                    _command(target, args),
                    env=child_env,
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

            for rank in range(n):
                procs.append(spawn(rank, (rank_env or {}).get(rank, {}), str(rank)))
            deadline = time.monotonic() + timeout
            for rank, extra in (replace or {}).items():
                try:
                    procs[rank].wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    break
                first_of[rank] = (procs[rank], logs[rank])
                procs[rank] = spawn(rank, {**extra, "PARAMPLANE_REPLACEMENT": "1"}, f"{rank}-replacement")
                logs[rank] = logs.pop()
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    outcome.timed_out = True
                    break
        finally:
            for proc in [*procs, *(p for p, _ in first_of.values())]:
                if proc.poll() is None:
                    outcome.timed_out = True
                _kill(proc)
            coordinator.stop()
        for rank, (proc, log) in sorted(first_of.items()):
            log.seek(0)
            outcome.replaced.append(
                RankOutcome(rank, proc.returncode, log.read().decode(errors="replace"), None)
            )
            log.close()
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            text = log.read().decode(errors="replace")
            log.close()
            path = results / f"rank-{rank}.json"
            result = json.loads(path.read_text()) if path.exists() else None
            outcome.ranks.append(RankOutcome(rank, proc.returncode, text, result))
    return outcome


def run_example(script: str, num_ranks: int, *args: str, timeout: float = 120.0) -> str:
    """Run ``examples/<script>`` under ``paramplane launch --standalone -n N``; its output (asserts exit 0)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramplane.cli",
            "launch",
            "--standalone",
            "-n",
            str(num_ranks),
            f"examples/{script}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout
