"""FSDP per-rank memory and step time, every strategy, beside torch FSDP2 (``fully_shard``, gloo).

    python benchmarks/fsdp.py [--width 2500] [--layers 8] [--steps 3] [--out benchmarks/results/fsdp.jsonl]

A stack of ``--layers`` Linear layers of ``--width`` (8 x 2500^2: about 50M float32
parameters, one FSDP unit each) trains with AdamW on random data, local batch
``--local-batch``, one BLAS thread per process. Memory is measured per rank over the
training steps: ``tracemalloc`` (numpy reports its buffers to it) runs from before the model
is built and its peak is reset when training starts, so ``live_peak`` is the most bytes a rank
holds while training (its parameters, or its shards, included; the full model every rank
builds first and FSDP frees at wrap time is not) and ``traced_peak`` that peak's growth over
the start of training; also the growth of peak RSS for both implementations. The 1-process
row is the same model trained without sharding. Hybrid strategies run on two fake
hosts of world/2 ranks; ``hybrid_shard+bfloat16`` compresses the inter-host all-reduce (``comm_dtype``). paramplane ranks get the launcher's MALLOC_* defaults; torch
gets none of our settings. One JSON line per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.benchmarks._jsonl import emit
from paramplane.launch import MALLOC_DEFAULTS
from paramplane.local_world import json_lines, run_world

THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MALLOC = MALLOC_DEFAULTS  # the launcher's, for paramplane ranks only
STRATEGIES = (
    "full_shard",
    "shard_grad_op",
    "no_shard",
    "hybrid_shard",
    "hybrid_shard_zero2",
    "hybrid_shard+bfloat16",
)


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_paramplane(args: argparse.Namespace) -> dict[str, Any]:
    from paramplane.nn import Linear, ReLU, Sequential
    from paramplane.optim import AdamW

    world = None
    if args.strategy != "single":
        import paramplane as pp

        world = pp.init()  # before tracing: the runtime's imports are not training memory
    tracemalloc.start()  # from before the model exists, so the live peak counts what a rank keeps
    rng = np.random.default_rng(0)
    layers: list[Any] = []
    for _ in range(args.layers):
        layers += [Linear(args.width, args.width, rng=rng), ReLU()]
    model: Any = Sequential(*layers[:-1])
    if world is not None:
        strategy, _, comm = args.strategy.partition("+")  # "hybrid_shard+bfloat16": compressed across hosts
        model = pp.FSDP(model, world.group, strategy, comm_dtype=comm or None)
    opt = AdamW(model.parameters(), lr=1e-4)
    if world is not None:
        model.attach(opt)
    x = np.random.default_rng(1).standard_normal((args.local_batch, args.width)).astype(np.float32)
    rss0 = _rss()
    live0, _ = (
        tracemalloc.get_traced_memory()
    )  # parameters (or shards) and the batch; construction's garbage is gone
    tracemalloc.reset_peak()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        y = model.forward(x)
        model.backward(np.ones_like(y) / y.size)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    _, traced = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    out = {
        "times": times,
        "traced_peak": traced - live0,
        "live_peak": traced,
        "rss_growth": _rss() - rss0,
        "rss_peak": _rss(),
    }
    if world is not None:
        out["measured_peak"] = model.memory_stats()["total"]["peak"]
        world.group.barrier()
        world.shutdown()
    return out


def worker_torch(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model: Any = torch.nn.Sequential(*layers[:-1])
    if args.strategy != "single":
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group(
            "gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world_size
        )
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.local_batch, args.width)
    rss0 = _rss()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        model(x).mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    out = {"times": times, "rss_growth": _rss() - rss0, "rss_peak": _rss()}
    if args.strategy != "single":
        dist.barrier()
        dist.destroy_process_group()
    return out


def _spawn(impl: str, strategy: str, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    base = [sys.executable, str(Path(__file__).resolve()), "--worker", impl, "--strategy", strategy]
    base += ["--world-size", str(world_size), "--steps", str(args.steps), "--width", str(args.width)]
    base += ["--layers", str(args.layers), "--local-batch", str(args.local_batch)]
    env = dict(os.environ, **THREADS, **(MALLOC if impl == "paramplane" else {}), PARAMPLANE_TIMEOUT="600")
    with tempfile.TemporaryDirectory() as tmp:
        return json_lines(
            run_world(
                world_size,
                lambda r: [*base, "--rank", str(r), "--store", os.path.join(tmp, "store")],
                env=env,
                coordinator=impl == "paramplane" and strategy != "single",
                rank_env=(lambda r: {"PARAMPLANE_HOST_ID": f"host{r // max(1, world_size // 2)}"})
                if strategy.startswith("hybrid")
                else None,
                timeout_s=1800.0,
                stderr="inherit",
            ),
            f"{impl} {strategy} at world {world_size}",
        )


def _row(
    impl: str, strategy: str, world: int, ranks: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    params = args.layers * (args.width * args.width + args.width)
    row: dict[str, Any] = {
        "bench": "fsdp",
        "impl": impl,
        "strategy": strategy,
        "world_size": world,
        "params": params,
        "local_batch": args.local_batch,
        # the first step creates optimizer state; later steps are the steady state
        "step_s_median": max(statistics.median(r["times"][1:] or r["times"]) for r in ranks),
        "rss_growth_max": max(r["rss_growth"] for r in ranks),
    }
    if "traced_peak" in ranks[0]:
        row["traced_peak_max"] = max(r["traced_peak"] for r in ranks)
        row["live_peak_max"] = max(r["live_peak"] for r in ranks)
    if "measured_peak" in ranks[0]:
        row["measured_peak_max"] = max(r["measured_peak"] for r in ranks)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2500)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--local-batch", type=int, default=8)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=("paramplane", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="single", help=argparse.SUPPRESS)
    parser.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.width, args.layers, args.steps, args.local_batch) < 1:
        parser.error("--width, --layers, --steps and --local-batch must be positive")
    if args.worker:
        fn = worker_paramplane if args.worker == "paramplane" else worker_torch
        print(json.dumps(fn(args)), flush=True)
        return 0
    try:
        import torch  # noqa: F401

        have_torch = not args.no_torch
    except ImportError:
        have_torch = False
    rows = [_row("paramplane", "single", 1, _spawn("paramplane", "single", 1, args), args)]
    if have_torch:
        rows.append(_row("torch", "single", 1, _spawn("torch", "single", 1, args), args))
    for world in (int(w) for w in args.worlds.split(",")):
        for strategy in args.strategies.split(","):
            rows.append(
                _row("paramplane", strategy, world, _spawn("paramplane", strategy, world, args), args)
            )
        if have_torch:
            rows.append(
                _row("torch", "fully_shard", world, _spawn("torch", "fully_shard", world, args), args)
            )
    single = rows[0]
    for row in rows:
        if row["impl"] == "paramplane" and row["world_size"] > 1:
            # The ratio: a rank's peak of live bytes while training (its parameters or shards included)
            # against the single process's over N; and the same for the growth over the start of training.
            row["peak_vs_single_over_n"] = row["live_peak_max"] / (
                single["live_peak_max"] / row["world_size"]
            )
            row["growth_vs_single_over_n"] = row["traced_peak_max"] / (
                single["traced_peak_max"] / row["world_size"]
            )
            torch_row = next(
                (
                    r
                    for r in rows
                    if r["impl"] == "torch"
                    and r["world_size"] == row["world_size"]
                    and r["strategy"] != "single"
                ),
                None,
            )
            if torch_row is not None:
                row["step_vs_torch_fsdp2"] = row["step_s_median"] / torch_row["step_s_median"]
    lines = [json.dumps(r) for r in rows]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
