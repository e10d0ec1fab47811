"""Time to form a world: paramplane's coordinator against torch.distributed (gloo, tcp://) when installed.

For each world size N a fresh world is formed by N new processes on this host:
``seconds`` runs from spawning them to the last one holding its rank (interpreter
start and imports included), ``join_seconds`` from the last process starting its
join call to the last one returning from it (the rendezvous alone). Medians over
``--repeats``. Output: JSON lines on stdout (and appended to ``--out``).

torch's ``init_process_group`` also connects the gloo pairs between ranks;
paramplane's join forms the world through the coordinator only (its data plane
connects lazily), so ``join_seconds`` compares rendezvous as each library does it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from paramplane.local_world import run_world

TIMEOUT_S = 120.0


def _worker(impl: str, address: str, rank: int, world_size: int) -> None:
    """One rank: import, join, print (join start, join end) on CLOCK_MONOTONIC (shared by processes on Linux)."""
    if impl == "paramplane":
        import asyncio

        from paramplane.node.coord_client import CoordinatorClient

        async def join() -> tuple[float, float]:
            async with CoordinatorClient(address) as client:
                start = time.monotonic()
                await client.join(
                    host_id=socket.gethostname(),
                    peer_address="",
                    instance_id=f"bench-{os.getpid()}",
                    rank_hint=rank,
                    world_size=world_size,
                    timeout_s=TIMEOUT_S,
                )
                end = time.monotonic()
                await client.leave()
                return start, end

        start, end = asyncio.run(join())
    else:
        from datetime import timedelta

        import torch.distributed as dist

        start = time.monotonic()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=TIMEOUT_S),
        )
        end = time.monotonic()
        dist.destroy_process_group()
    print(json.dumps({"start": start, "end": end}), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _form_world(impl: str, address: str, world_size: int) -> tuple[float, float]:
    """Spawn ``world_size`` workers (``run_world``); answers (spawn to all joined, join alone) in seconds."""
    args = [sys.executable, __file__, "--worker", impl, "--address", address, "--world-size", str(world_size)]
    spawned = time.monotonic()
    # The coordinator is started by the caller, before the clock: the time is the ranks' alone.
    world = run_world(world_size, lambda r: [*args, "--rank", str(r)], timeout_s=TIMEOUT_S, coordinator=False)
    reports = []
    for r in world.ranks:
        lines = [line for line in r.output.splitlines() if line.startswith("{")]
        if r.returncode != 0 or world.timed_out or not lines:
            raise RuntimeError(f"{impl} rank {r.rank} exited with {r.returncode}: {r.output.strip()[-2000:]}")
        reports.append(json.loads(lines[-1]))
    last_end = max(r["end"] for r in reports)
    return last_end - spawned, last_end - max(r["start"] for r in reports)


def _measure(impl: str, world_size: int, repeats: int) -> dict[str, Any]:
    totals, joins = [], []
    for _ in range(repeats):
        if impl == "paramplane":
            from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread

            with CoordinatorThread(CoordinatorConfig(port=0, world_size=world_size)) as coordinator:
                total, join = _form_world(impl, coordinator.address, world_size)
        else:
            total, join = _form_world(impl, f"127.0.0.1:{_free_port()}", world_size)
        totals.append(total)
        joins.append(join)
    return {
        "bench": "rendezvous",
        "impl": impl,
        "world_size": world_size,
        "seconds": statistics.median(totals),
        "join_seconds": statistics.median(joins),
        "repeats": repeats,
    }


def _emit(row: dict[str, Any], out: Path | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as f:
            f.write(line + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8], help="world sizes (default 2 4 8)")
    parser.add_argument(
        "--repeats", type=int, default=3, help="worlds formed per size and library (default 3)"
    )
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    parser.add_argument("--worker", choices=["paramplane", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.address, args.rank, args.world_size)
        return 0
    if args.repeats < 1 or min(args.sizes) < 1:
        parser.error("--repeats and --sizes must be >= 1")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        import torch.distributed as dist

        have_torch = dist.is_available() and dist.is_gloo_available()
    except ImportError:
        have_torch = False
    for n in args.sizes:
        ours = _measure("paramplane", n, args.repeats)
        _emit(ours, args.out)
        if have_torch:
            theirs = _measure("torch", n, args.repeats)
            _emit(theirs, args.out)
            _emit(
                {
                    "bench": "rendezvous",
                    "impl": "ratio",
                    "world_size": n,
                    "ratio": theirs["seconds"] / ours["seconds"],
                    "join_ratio": theirs["join_seconds"] / ours["join_seconds"],
                    "definition": "torch.distributed (gloo) time / paramplane time; above 1 = paramplane faster",
                },
                args.out,
            )
    if not have_torch:
        print("torch.distributed with gloo is not installed: no peer measured", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
