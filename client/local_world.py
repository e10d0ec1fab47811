"""Start a world of rank processes on this host, for tests and benchmarks: the one helper both use.

``run_world(n, command)`` starts a coordinator (127.0.0.1, port 0) in this process when asked, runs
``command(rank)`` as ranks 0..n-1 with the ``PARAMPLANE_*`` variables ``pp.init()`` reads, waits for them
all until a deadline, kills only the process groups it started (by PID) and stops the coordinator. Each
rank's output is kept in a file (no pipe can fill up and stall a rank). ``paramplane launch`` is the user's
way to start ranks (restarts, signal forwarding, prefixed output); this is the in-process one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

__all__ = ["RankRun", "WorldRun", "json_lines", "run_world"]


@dataclass
class RankRun:
    """What one rank process left behind."""

    rank: int
    """The rank it was started as (PARAMPLANE_RANK)."""
    returncode: int | None
    """Exit status (negative: killed by that signal, e.g. -9 after the deadline)."""
    output: str
    """stdout, with stderr unless it went to this process's stderr (``stderr="inherit"``)."""


@dataclass
class WorldRun:
    """Every rank's run and whether any had to be killed."""

    ranks: list[RankRun] = field(default_factory=list)
    """In rank order (a replaced rank's replacement)."""
    timed_out: bool = False
    """The deadline passed and the ranks still running were killed."""
    replaced: list[RankRun] = field(default_factory=list)
    """The first processes of the ranks that were replaced (``run_world(replace=...)``)."""


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc``'s process group (ours: it was started in a session of its own) and reap it."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def run_world(
    num_ranks: int,
    command: Callable[[int], Sequence[str]],
    *,
    env: Mapping[str, str] | None = None,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
    timeout_s: float = 60.0,
    coordinator: bool = True,
    coordinator_options: Mapping[str, Any] | None = None,
    token: str | None = None,
    replace: Mapping[int, Mapping[str, str]] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stderr: Literal["merge", "inherit"] = "merge",
) -> WorldRun:
    """Run ``command(rank)`` as ranks 0..num_ranks-1 of one world; every process is gone when this returns.

    Each rank's environment is ``env`` (default: this process's), then PARAMPLANE_RANK, with ``coordinator``
    PARAMPLANE_COORDINATOR (a fresh one, ``coordinator_options`` overriding its ``CoordinatorConfig``) and
    PARAMPLANE_WORLD_SIZE, PARAMPLANE_TOKEN when ``token`` is given, then ``rank_env(rank)``. After
    ``timeout_s`` the ranks still running are killed and ``timed_out`` is set. For each rank in ``replace``,
    once its process exited a replacement starts as the same rank with PARAMPLANE_REPLACEMENT=1 and
    ``replace[rank]`` added (the survivors' ``World.reform()`` admits it).
    """
    if num_ranks < 1:
        raise ValueError(f"a world needs at least one rank, got {num_ranks}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    base = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    server = None
    if coordinator:
        from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

        config = CoordinatorConfig(host="127.0.0.1", port=0, world_size=num_ranks, token=token)
        server = CoordinatorThread(dataclasses.replace(config, **(coordinator_options or {})))
        base.update(PARAMPLANE_COORDINATOR=server.start(), PARAMPLANE_WORLD_SIZE=str(num_ranks))
    if token is not None:
        base["PARAMPLANE_TOKEN"] = token
    outcome = WorldRun()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[bytes]] = []
    first_of: dict[int, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}
    with tempfile.TemporaryDirectory(prefix="pp-world-") as scratch:
        try:

            def spawn(rank: int, extra: Mapping[str, str], label: str) -> subprocess.Popen[bytes]:
                child_env = dict(base, PARAMPLANE_RANK=str(rank), **(rank_env(rank) if rank_env else {}))
                child_env.update(extra)
                log = open(Path(scratch) / f"log-{label}.txt", "w+b")  # noqa: SIM115 (closed below)
                logs.append(log)
                return subprocess.Popen(
                    list(command(rank)),
                    env=child_env,
                    cwd=cwd,
                    stdout=log,
                    stderr=subprocess.STDOUT if stderr == "merge" else None,
                    start_new_session=True,
                )

            for rank in range(num_ranks):
                procs.append(spawn(rank, {}, str(rank)))
            deadline = time.monotonic() + timeout_s
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
            if server is not None:
                server.stop()
        for rank, (proc, log) in sorted(first_of.items()):
            outcome.replaced.append(RankRun(rank, proc.returncode, _read(log)))
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            outcome.ranks.append(RankRun(rank, proc.returncode, _read(log)))
    return outcome


def _read(log: IO[bytes]) -> str:
    log.seek(0)
    text = log.read().decode(errors="replace")
    log.close()
    return text


def json_lines(world: WorldRun, what: str) -> list[dict[str, Any]]:
    """Each rank's last output line parsed as JSON, in rank order (how benchmark ranks report); RuntimeError
    naming ``what`` when a rank failed or the world timed out."""
    failed = [(r.rank, r.returncode) for r in world.ranks if r.returncode != 0]
    if failed or world.timed_out:
        tail = next((r.output[-2000:] for r in world.ranks if r.returncode != 0), "")
        late = " (timed out)" if world.timed_out else ""
        raise RuntimeError(f"{what}: ranks exited with {failed} (of {len(world.ranks)}){late}\n{tail}")
    return [json.loads(r.output.strip().splitlines()[-1]) for r in world.ranks]
