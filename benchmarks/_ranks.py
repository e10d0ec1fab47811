"""The one way benchmarks start a world: rank processes on this host, a fresh coordinator when asked,
each rank's last stdout line read back as JSON."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping
from typing import Any


def run_ranks(
    command: Callable[[int], list[str]],
    num_ranks: int,
    env: Mapping[str, str],
    *,
    what: str,
    coordinator: bool = True,
    rank_env: Callable[[int], Mapping[str, str]] | None = None,
    timeout_s: float = 1800.0,
) -> list[dict[str, Any]]:
    """Run ``command(rank)`` for every rank with ``env`` (plus PARAMPLANE_RANK, the coordinator's address and
    the world size when ``coordinator``); return each rank's last output line parsed as JSON, in rank order.
    Ranks still running at the end are killed; a rank that failed raises RuntimeError naming ``what``."""
    base = dict(env)
    coord = None
    if coordinator:
        from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

        coord = CoordinatorThread(CoordinatorConfig(world_size=num_ranks, host="127.0.0.1", port=0))
        base.update(PARAMPLANE_COORDINATOR=coord.start(), PARAMPLANE_WORLD_SIZE=str(num_ranks))
    procs: list[subprocess.Popen[str]] = []
    try:
        for r in range(num_ranks):
            full = dict(base, PARAMPLANE_RANK=str(r), **(rank_env(r) if rank_env else {}))
            procs.append(subprocess.Popen(command(r), env=full, stdout=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        if coord is not None:
            coord.stop()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{what}: ranks exited with {failed} (of {num_ranks})")
    return [json.loads(o.strip().splitlines()[-1]) for o in outs]
