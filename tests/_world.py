"""Multi-process worlds for data-plane tests, on ``paramplane.local_world`` (the helper benchmarks use too).

``run_world(n, target)`` runs ``target`` (a worker script or a ``-m`` module name) as
``n`` ranks of a fresh world and reads what each reported. Ranks report through JSON files: a worker writes
``$PARAMPLANE_TEST_OUT/rank-<r>.json`` (see ``tests/workers/_common.py``).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _zygote

from paramplane import local_world
from paramplane.launch import MALLOC_DEFAULTS, thread_env

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


def _command(
    target: str, args: Sequence[str], env: Mapping[str, str], used: set[_zygote.Zygote]
) -> list[str]:
    """How to start ``target`` as a rank with environment ``env``: forked from a zygote where one serves (a
    torch worker: ``tests/_zygote.py``; added to ``used``), else ``python target``."""
    path = Path(target)
    if target.endswith(".py"):
        if not path.is_absolute():
            path = WORKERS / path if (WORKERS / path).exists() else REPO / path
        zygote = _zygote.for_rank(path, env)
        if zygote is not None:
            used.add(zygote)
            return zygote.command(path, args)
        return [sys.executable, str(path), *args]
    return [sys.executable, "-m", target, *args]


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
    """Run ``target`` as ranks 0..n-1 of one world (``paramplane.local_world``) and collect what each left.

    ``env`` is added to every rank's environment, ``rank_env[r]`` to rank r's only; the ranks also get
    PARAMPLANE_TEST_OUT (the folder for their JSON results) and, as ``paramplane launch`` gives its ranks, an
    equal share of the cores as their intra-op thread count (``launch.thread_env``). After ``timeout`` seconds the ranks still
    running are killed and ``timed_out`` is set. ``replace`` as in ``local_world.run_world``.
    """
    options: dict[str, Any] = {
        "join_timeout_s": max(10.0, timeout),
        "heartbeat_interval_s": heartbeat_interval_s,
        "heartbeat_timeout_s": heartbeat_timeout_s,
    }
    if progress_timeout_s is not None:
        options["progress_timeout_s"] = progress_timeout_s
    with tempfile.TemporaryDirectory(prefix="pp-results-") as scratch:
        results = Path(out_dir) if out_dir is not None else Path(scratch)
        common = {"PARAMPLANE_TEST_OUT": str(results), "PARAMPLANE_JOIN_TIMEOUT": str(max(10.0, timeout))}
        # the launcher's thread share per rank, unless this process's environment sets one
        base = {**thread_env(n), **os.environ, **common, **(env or {})}
        zygotes: set[_zygote.Zygote] = set()
        # before the coordinator starts its join deadline: a zygote's first start imports for seconds
        commands = [
            _command(target, args, {**base, "PYTHONUNBUFFERED": "1", **(rank_env or {}).get(r, {})}, zygotes)
            for r in range(n)
        ]
        run = local_world.run_world(
            n,
            lambda rank: commands[rank],
            env=base,
            rank_env=lambda rank: (rank_env or {}).get(rank, {}),
            timeout_s=timeout,
            coordinator_options=options,
            token=token,
            replace=replace,
            cwd=REPO,
        )
        for zygote in zygotes:  # the ranks it forked for this world are gone too, as exec'd ones would be
            zygote.drain()
        outcome = WorldOutcome(timed_out=run.timed_out)
        outcome.replaced = [RankOutcome(r.rank, r.returncode, r.output, None) for r in run.replaced]
        for r in run.ranks:
            path = results / f"rank-{r.rank}.json"
            result = json.loads(path.read_text()) if path.exists() else None
            outcome.ranks.append(RankOutcome(r.rank, r.returncode, r.output, result))
    return outcome


def run_example(script: str, num_ranks: int, *args: str, timeout: float = 120.0) -> str:
    """Run ``examples/<script>`` under ``paramplane launch --standalone -n N``; its output (asserts exit 0).
    A torch example's ranks are forked from the test zygote (``launch --no-python`` runs its client), with
    the environment the launcher gives a rank; the launcher supervises them as it would exec'd ones."""
    path = REPO / "examples" / script
    env = {**MALLOC_DEFAULTS, **thread_env(num_ranks), **os.environ, "GRPC_ENABLE_FORK_SUPPORT": "0"}
    zygote = _zygote.for_rank(path, {**env, "PYTHONUNBUFFERED": "1"})
    target = ["--no-python", *zygote.command(path, args)] if zygote is not None else [str(path), *args]
    proc = subprocess.run(
        [sys.executable, "-m", "paramplane.cli", "launch", "--standalone", "-n", str(num_ranks), *target],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def listening_port(proc: subprocess.Popen[bytes], deadline: float) -> int:
    """Read the coordinator's output until its "listening on HOST:PORT" line (select, no polling)."""
    assert proc.stdout is not None
    seen = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
        if b"listening on" in line:
            return int(line.split(b"listening on", 1)[1].split()[0].rsplit(b":", 1)[1])
    raise AssertionError(f"coordinator did not report its port: {seen.decode(errors='replace')}")
