"""Sharded checkpoint throughput: save and load of an FSDP model's state, beside torch.distributed.checkpoint.

    python benchmarks/checkpoint.py [--width 2500] [--layers 8] [--worlds 2,4] [--out benchmarks/results/checkpoint.jsonl]

The state is an FSDP full_shard model of ``--layers`` Linear units of ``--width``^2 float32 (8 x 2500^2:
about 200 MB) sharded over the world; torch's is the same model under FSDP2 ``fully_shard`` (gloo) saved
with ``torch.distributed.checkpoint`` (DCP). GB/s = state bytes / wall time of the collective save (or
load), taken on the slowest rank, into a fresh directory under ``--dir`` (default: a temporary folder, so
the page cache is warm: this measures the software path more than the disk). One JSON line per row.

Recovery rows (``bench: recovery``): the same layers under pp.DDP with AdamW state (params + 2 moments,
3x the model's bytes); the last rank plays a replacement and the time it needs to get that state is taken
two ways: live from a healthy peer over the data plane (``pp.checkpoint.sync``) and from a checkpoint on
disk (``pp.checkpoint.load``, page cache warm).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.benchmarks._jsonl import emit
from paramplane.local_world import json_lines, run_world

THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def worker_paramplane(args: argparse.Namespace) -> dict[str, Any]:
    import paramplane as pp
    from paramplane.nn import Linear, Sequential

    rng = np.random.default_rng(0)
    model = Sequential(*(Linear(args.width, args.width, rng=rng) for _ in range(args.layers)))
    with pp.init() as world:
        fsdp = pp.FSDP(model, world.group)
        path = Path(args.dir) / "pp"
        world.group.barrier()
        t = time.perf_counter()
        pp.checkpoint.save({"model": fsdp}, path, world.group)
        save = time.perf_counter() - t
        world.group.barrier()
        t = time.perf_counter()
        pp.checkpoint.load({"model": fsdp}, path, world.group)
        load = time.perf_counter() - t
        world.group.barrier()
    return {"save_s": save, "load_s": load}


def worker_recovery(args: argparse.Namespace) -> dict[str, Any]:
    import paramplane as pp
    from paramplane.nn import Linear, Sequential
    from paramplane.optim import AdamW

    rng = np.random.default_rng(0)
    model = Sequential(*(Linear(args.width, args.width, rng=rng) for _ in range(args.layers)))
    with pp.init() as world:
        ddp = pp.DDP(model, world.group, init_sync=False)  # same seed everywhere: already replicas
        opt = AdamW(ddp.parameters(), lr=1e-3)
        for p in ddp.parameters():
            p.grad = np.full_like(p.data, 1e-3)
        opt.step()  # the moments exist
        state = {"model": ddp, "optim": opt, "step": 5}
        replacement = world.rank == world.world_size - 1
        path = Path(args.dir) / "recovery"
        pp.checkpoint.save(state, path, world.group)
        world.group.barrier()
        t = time.perf_counter()
        pp.checkpoint.sync(state, world.group, has_state=not replacement)
        live = time.perf_counter() - t
        world.group.barrier()
        t = time.perf_counter()
        pp.checkpoint.load(state, path, world.group)
        disk = time.perf_counter() - t
        world.group.barrier()
    return {"live_s": live, "disk_s": disk, "replacement": replacement}


def worker_torch(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world_size
    )
    model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    path = str(Path(args.dir) / "torch")
    dist.barrier()
    t = time.perf_counter()
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    save = time.perf_counter() - t
    dist.barrier()
    state = {"model": model.state_dict()}
    t = time.perf_counter()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    load = time.perf_counter() - t
    dist.barrier()
    dist.destroy_process_group()
    return {"save_s": save, "load_s": load}


def _spawn(impl: str, world: int, args: argparse.Namespace, folder: str) -> list[dict[str, Any]]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        impl,
        "--world-size",
        str(world),
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--dir",
        folder,
    ]
    return json_lines(
        run_world(
            world,
            lambda r: [*cmd, "--rank", str(r), "--store", os.path.join(folder, "store")],
            env=dict(os.environ, **THREADS, PARAMPLANE_TIMEOUT="600"),
            coordinator=impl != "torch",
            timeout_s=1800.0,
            stderr="inherit",
        ),
        f"{impl} at world {world}",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2500)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument(
        "--dir", default=None, help="where checkpoints are written (default: a temporary folder)"
    )
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--no-recovery", action="store_true", help="skip the live-vs-disk recovery rows")
    parser.add_argument("--worker", choices=("paramplane", "torch", "recovery"), help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        fn = {"paramplane": worker_paramplane, "torch": worker_torch, "recovery": worker_recovery}[
            args.worker
        ]
        print(json.dumps(fn(args)), flush=True)
        return 0
    impls = ["paramplane"]
    if not args.no_torch:
        try:
            import torch  # noqa: F401

            impls.append("torch")
        except ImportError:
            pass
    nbytes = args.layers * (args.width * args.width + args.width) * 4
    lines = []
    for world in (int(w) for w in args.worlds.split(",")):
        for impl in impls:
            folder = tempfile.mkdtemp(prefix="pp-ckpt-bench-", dir=args.dir)
            try:
                ranks = _spawn(impl, world, args, folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            save, load = max(r["save_s"] for r in ranks), max(r["load_s"] for r in ranks)
            lines.append(
                json.dumps(
                    {
                        "bench": "checkpoint",
                        "impl": impl,
                        "world_size": world,
                        "state_bytes": nbytes,
                        "save_s": save,
                        "load_s": load,
                        "save_gb_s": nbytes / save / 1e9,
                        "load_gb_s": nbytes / load / 1e9,
                    }
                )
            )
        if args.no_recovery:
            continue
        folder = tempfile.mkdtemp(prefix="pp-ckpt-bench-", dir=args.dir)
        try:
            ranks = _spawn("recovery", world, args, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        (rep,) = [r for r in ranks if r["replacement"]]
        lines.append(
            json.dumps(
                {
                    "bench": "recovery",
                    "world_size": world,
                    "transport": os.environ.get("PARAMPLANE_TRANSPORT", "auto"),
                    "state_bytes": 3 * nbytes,
                    "live_s": rep["live_s"],
                    "disk_s": rep["disk_s"],
                    "live_gb_s": 3 * nbytes / rep["live_s"] / 1e9,
                    "disk_gb_s": 3 * nbytes / rep["disk_s"] / 1e9,
                    "disk_over_live": rep["disk_s"] / rep["live_s"],
                }
            )
        )
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
