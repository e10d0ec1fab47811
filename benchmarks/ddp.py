"""DDP step time: one process vs 2 ranks (paramplane over shm and gRPC; torch DDP over gloo beside it).

    python benchmarks/ddp.py [--steps 10] [--out benchmarks/results/ddp.jsonl]

An MLP of about 10M float32 parameters trains with SGD on random data, ``--local-batch``
samples per process. Every process uses one BLAS thread (2 ranks on a 2-core machine
get one core each), and the 1-process baseline runs the same local batch, so
``overhead_fraction = (t_2ranks - t_1proc) / t_2ranks`` is the share of a DDP step
spent on (unhidden) communication. torch rows use the same layer shapes when torch
imports. One JSON line per configuration on stdout and in ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.benchmarks._jsonl import emit
from paramplane.launch import MALLOC_DEFAULTS
from paramplane.local_world import json_lines, run_world

SIZES = (1024, 2048, 2048, 2048, 10)  # 2.1M + 4.2M + 4.2M + 20k weights: about 10.5M parameters
MALLOC = MALLOC_DEFAULTS  # the launcher's, for paramplane ranks only
THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _pp_model(seed: int) -> Any:
    from paramplane.nn import Linear, ReLU, Sequential

    rng = np.random.default_rng(seed)
    layers: list[Any] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [Linear(a, b, rng=rng), ReLU()]
    return Sequential(*layers[:-1])


def _time_steps(step: Any, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def worker_paramplane(args: argparse.Namespace) -> dict[str, Any]:
    """One rank (or the plain 1-process baseline when ``--world-size 1``)."""
    from paramplane.nn import CrossEntropyLoss
    from paramplane.optim import SGD

    model = _pp_model(0)
    world = None
    ddp: Any = model
    if args.world_size > 1:
        import paramplane as pp
        from paramplane.parallel.ddp import DDP

        world = pp.init()
        ddp = DDP(model, world.group, bucket_mb=args.bucket_mb, comm_dtype=args.comm_dtype or None)
    opt = SGD(model.parameters(), lr=1e-3)
    if world is not None:
        ddp.attach(opt)
    crit = CrossEntropyLoss()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((args.local_batch, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], args.local_batch)

    def step() -> None:
        opt.zero_grad()
        crit.forward(ddp.forward(x), y)
        ddp.backward(crit.backward())
        opt.step()

    try:
        times = _time_steps(step, args.warmup, args.steps)
        if world is not None:
            world.group.barrier()
    finally:
        if world is not None:
            world.shutdown()
    return {"params": sum(p.size for p in model.parameters()), "times": times}


def worker_torch(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[Any] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model: Any = torch.nn.Sequential(*layers[:-1])
    if args.world_size > 1:
        dist.init_process_group(
            "gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world_size
        )
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    crit = torch.nn.CrossEntropyLoss()
    x = torch.randn(args.local_batch, SIZES[0])
    y = torch.randint(0, SIZES[-1], (args.local_batch,))

    def step() -> None:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()

    try:
        times = _time_steps(step, args.warmup, args.steps)
    finally:
        if args.world_size > 1:
            dist.barrier()
            dist.destroy_process_group()
    return {"params": sum(p.numel() for p in model.parameters()), "times": times}


def _spawn(impl: str, world_size: int, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """Run ``world_size`` worker processes; rank 0's timings."""
    base = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, "--world-size", str(world_size)]
    base += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--local-batch", str(args.local_batch)]
    base += ["--bucket-mb", str(args.bucket_mb), "--comm-dtype", env.pop("COMM_DTYPE", "")]
    extra = dict(os.environ, **THREADS, **env)
    if impl == "paramplane":  # our launcher's defaults for our ranks; a peer runs at its own defaults
        for key, value in MALLOC.items():
            extra.setdefault(key, value)
    with tempfile.TemporaryDirectory() as tmp:
        ranks = json_lines(
            run_world(
                world_size,
                lambda r: [*base, "--rank", str(r), "--store", os.path.join(tmp, "store")],
                env=extra,
                coordinator=impl == "paramplane" and world_size > 1,
                timeout_s=600,
                stderr="inherit",
            ),
            f"{impl} at world {world_size}",
        )
    return ranks[0]


def _row(
    impl: str, transport: str, world_size: int, res: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    times = res["times"]
    return {
        "bench": "ddp",
        "impl": impl,
        "transport": transport,
        "world_size": world_size,
        "params": res["params"],
        "local_batch": args.local_batch,
        "bucket_mb": args.bucket_mb,
        "steps": len(times),
        "step_s_median": statistics.median(times),
        "step_s_min": min(times),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--local-batch", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--out", type=Path, help="append JSON lines here too")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch rows")
    parser.add_argument("--worker", choices=("paramplane", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--comm-dtype", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.local_batch < 1 or not args.bucket_mb > 0:
        parser.error("--steps, --local-batch and --bucket-mb must be positive, --warmup >= 0")
    if args.worker:
        res = worker_paramplane(args) if args.worker == "paramplane" else worker_torch(args)
        print(json.dumps(res), flush=True)
        return 0

    rows = []
    base = _spawn("paramplane", 1, args, {})
    rows.append(_row("paramplane", "none", 1, base, args))
    for transport in ("shm", "grpc"):
        # grpc stands for the inter-host path: loopback TCP lanes, not a same-machine Unix socket.
        res = _spawn("paramplane", 2, args, {"PARAMPLANE_TRANSPORT": transport, "PARAMPLANE_UNIX_LANE": "0"})
        rows.append(_row("paramplane", transport, 2, res, args))
    # Gradient compression (DDP comm_dtype): half the bytes on the wire, where the wire is gRPC.
    res = _spawn(
        "paramplane",
        2,
        args,
        {"PARAMPLANE_TRANSPORT": "grpc", "PARAMPLANE_UNIX_LANE": "0", "COMM_DTYPE": "bfloat16"},
    )
    rows.append(dict(_row("paramplane", "grpc", 2, res, args), comm_dtype="bfloat16"))
    try:
        import torch  # noqa: F401

        have_torch = not args.no_torch
    except ImportError:
        have_torch = False
    if have_torch:
        rows.append(_row("torch", "none", 1, _spawn("torch", 1, args, {}), args))
        rows.append(_row("torch", "gloo", 2, _spawn("torch", 2, args, {}), args))
    for row in rows:
        if row["world_size"] > 1:
            one = next(r for r in rows if r["impl"] == row["impl"] and r["world_size"] == 1)
            t2, t1 = row["step_s_median"], one["step_s_median"]
            row["overhead_fraction"] = (t2 - t1) / t2
            # From the fastest steps: less sensitive to other load on a small machine.
            row["overhead_fraction_min"] = (row["step_s_min"] - one["step_s_min"]) / row["step_s_min"]
    lines = [json.dumps(r) for r in rows]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
