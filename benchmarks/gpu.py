"""The NCCL path on a GPU: paramplane against raw cupy NCCL and torch's NCCL, as ratios.

    python benchmarks/gpu.py [--sizes 1M,16M,64M] [--steps 10] [--out benchmarks/results/gpu.jsonl]

Two ranks on one machine, each its own process. Where the machine has fewer GPUs than ranks they share
GPU 0, and every implementation then needs ``NCCL_HOSTID`` set per rank (NCCL refuses two ranks of one
communicator on one device otherwise) and ``NCCL_SOCKET_IFNAME=lo``: this harness sets both for the
cupy and torch peers, exactly what paramplane's runtime sets for its own ranks, so all three run the same
NCCL transport. Nothing else is tuned for anyone.

Rows (JSON lines on stdout and in ``--out``):

- ``all_reduce``: float32 sum of ``--sizes`` bytes, each op timed to the device's completion (a device
  synchronize after it, for every implementation alike); median of ``--iters`` after warm-up. Peers:
  ``cupy`` (``cupy.cuda.nccl.NcclCommunicator.allReduce`` on one stream), ``torch``
  (``torch.distributed.all_reduce``, backend nccl).
- ``ddp`` / ``fsdp``: a step (forward, backward, SGD step) of a float32 MLP of ``--width`` x ``--layers``
  on CUDA: ``pp.DDP`` against ``torch.nn.parallel.DistributedDataParallel``, ``pp.FSDP`` (full_shard,
  one unit per Linear) against FSDP2's ``fully_shard`` (one per Linear, then the root), and one process
  with no wrapper for scale. Median step time of ``--steps`` after warm-up.

Each row carries ``ratio_vs_torch`` (and ``ratio_vs_cupy`` for ``all_reduce``): our time over the peer's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paramplane.benchmarks._gpu import peer_rank_env
from paramplane.benchmarks._jsonl import emit
from paramplane.local_world import json_lines, run_world

IMPLS = ("paramplane", "cupy", "torch")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def _median_time(fn: Callable[[], object], sync: Callable[[], None], warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _mlp(args: argparse.Namespace) -> Any:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).cuda()


def _train_step(model: Any, args: argparse.Namespace) -> Callable[[], None]:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.local_batch, args.width, device="cuda")
    y = torch.randn(args.local_batch, args.width, device="cuda")

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of ``args.worker`` running ``args.kind``; its timings as one JSON object."""
    import cupy
    import torch

    import paramplane as pp

    out: dict[str, Any] = {}
    world = None
    if args.worker == "paramplane":
        world = pp.init()
        device = world.use_gpu()
    else:
        device = args.rank % cupy.cuda.runtime.getDeviceCount()
        cupy.cuda.Device(device).use()
    torch.cuda.set_device(device)

    def sync() -> None:
        cupy.cuda.Device(device).synchronize()  # the whole device: torch's and cupy's streams alike

    dist: Any = None
    if args.worker == "torch" and args.world_size > 1:
        import torch.distributed as dist

        dist.init_process_group(
            "nccl", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world_size
        )
    try:
        if args.kind == "all_reduce":
            comm = None
            if args.worker == "cupy":
                from cupy.cuda import nccl

                store = torch.distributed.FileStore(args.store, args.world_size)
                if args.rank == 0:  # bytes (cupy 14) or a tuple of signed chars (older cupy)
                    raw = nccl.get_unique_id()
                    store.set("uid", json.dumps([isinstance(raw, bytes), list(raw)]))
                is_bytes, values = json.loads(store.get("uid"))
                uid = bytes(values) if is_bytes else tuple(values)
                comm = nccl.NcclCommunicator(args.world_size, uid, args.rank)
            stream = cupy.cuda.Stream(non_blocking=True)
            for size in args.sizes:
                x = cupy.ones(size // 4, dtype=cupy.float32)
                t = torch.from_dlpack(x)  # the same memory, for torch's peer
                fn: Callable[[], object]
                if args.worker == "paramplane":
                    assert world is not None
                    fn = functools.partial(world.group.all_reduce, x)
                elif args.worker == "cupy":
                    from cupy.cuda import nccl

                    def fn(x: Any = x) -> None:
                        assert comm is not None
                        comm.allReduce(
                            x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr
                        )
                        stream.synchronize()
                else:
                    assert dist is not None
                    fn = functools.partial(dist.all_reduce, t)
                iters = args.iters or (50 if size <= (1 << 22) else 15)
                out[str(size)] = _median_time(fn, sync, 5, iters)
        else:
            model = _mlp(args)
            if args.kind == "single":
                pass
            elif args.worker == "paramplane" and args.kind == "ddp":
                assert world is not None
                model = pp.DDP(
                    model, world.group, **({"bucket_mb": args.bucket_mb} if args.bucket_mb else {})
                )
            elif args.worker == "paramplane":
                assert world is not None
                model = pp.FSDP(model, world.group, "full_shard", units=pp.units_by_class(torch.nn.Linear))
            elif args.worker == "torch" and args.kind == "ddp":
                model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device])
            elif args.worker == "torch":
                from torch.distributed.fsdp import fully_shard

                for layer in model:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer)
                fully_shard(model)
            out["params"] = sum(p.numel() for p in _mlp(args).parameters())
            out["step_s"] = _median_time(_train_step(model, args), sync, args.warmup, args.steps)
    finally:
        if world is not None:
            world.group.barrier()
            world.shutdown()
        if dist is not None:
            dist.barrier()
            dist.destroy_process_group()
    return out


def _spawn(impl: str, kind: str, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``world_size`` ranks of ``impl``; rank 0's result."""
    base = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, "--kind", kind]
    base += ["--world-size", str(world_size), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    base += ["--width", str(args.width), "--layers", str(args.layers), "--local-batch", str(args.local_batch)]
    base += ["--sizes", ",".join(str(s) for s in args.sizes), "--iters", str(args.iters)]
    base += ["--bucket-mb", str(args.bucket_mb)]
    import cupy

    rank_env = peer_rank_env(impl, world_size, cupy.cuda.runtime.getDeviceCount())
    with tempfile.TemporaryDirectory() as tmp:
        ranks = json_lines(
            run_world(
                world_size,
                lambda r: [*base, "--rank", str(r), "--store", os.path.join(tmp, "store")],
                rank_env=rank_env,
                coordinator=impl == "paramplane",
                timeout_s=args.timeout,
                stderr="inherit",
            ),
            f"{impl} {kind} at world {world_size}",
        )
    return ranks[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda s: [_size(p) for p in s.split(",")], default="1M,16M,64M")
    parser.add_argument("--iters", type=int, default=0, help="timed all_reduce ops per size (0: by size)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--local-batch", type=int, default=64)
    parser.add_argument("--kinds", default="all_reduce,ddp,fsdp")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=0.0,
        help="pp.DDP's bucket size for a diagnostic row (0: its default)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per world")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--kind", default="all_reduce", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.width < 1 or args.layers < 1 or args.local_batch < 1:
        parser.error("--steps, --width, --layers and --local-batch must be positive, --warmup >= 0")
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0

    import cupy
    import torch
    from cupy.cuda import nccl

    setting = {
        "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "num_gpus": cupy.cuda.runtime.getDeviceCount(),
        "nccl": nccl.get_version(),
        "torch": torch.__version__,
        "cupy": cupy.__version__,
    }
    lines: list[str] = []
    kinds = args.kinds.split(",")
    if "all_reduce" in kinds:
        res = {impl: _spawn(impl, "all_reduce", 2, args) for impl in IMPLS}
        for size in args.sizes:
            ours = res["paramplane"][str(size)]
            row = {"bench": "gpu_all_reduce", "bytes": size, "world_size": 2, **setting}
            row |= {f"{impl}_s": res[impl][str(size)] for impl in IMPLS}
            row |= {
                "ratio_vs_cupy": ours / res["cupy"][str(size)],
                "ratio_vs_torch": ours / res["torch"][str(size)],
            }
            lines.append(json.dumps(row))
    single = _spawn("torch", "single", 1, args) if {"ddp", "fsdp"} & set(kinds) else None
    for kind in ("ddp", "fsdp"):
        if kind not in kinds:
            continue
        ours, peer = _spawn("paramplane", kind, 2, args), _spawn("torch", kind, 2, args)
        row = {"bench": f"gpu_{kind}", "world_size": 2, "params": ours["params"], "width": args.width}
        row |= {"layers": args.layers, "local_batch": args.local_batch, **setting}
        if kind == "ddp" and args.bucket_mb:
            row["paramplane_bucket_mb"] = args.bucket_mb  # a diagnostic, not both at their defaults
        row |= {"paramplane_step_s": ours["step_s"], "torch_step_s": peer["step_s"]}
        row["ratio_vs_torch"] = ours["step_s"] / peer["step_s"]
        assert single is not None
        row["one_process_step_s"] = single["step_s"]
        lines.append(json.dumps(row))
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
