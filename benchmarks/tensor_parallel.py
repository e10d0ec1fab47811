"""Tensor-parallel step time on tp = 2 ranks against the dense model on one: the numpy MLP, and torch blocks.

    python benchmarks/tensor_parallel.py [--dim 1024] [--hidden 4096] [--batch 64] [--steps 5] [--repeats 2]
                                         [--suite numpy|torch|all] [--out benchmarks/results/tensor_parallel.jsonl]

One training step is forward, backward and an SGD update, float32, one BLAS thread per process.
The dense row runs the same model (same seeds) in one process; the tp row runs 2 ranks, each
holding half of both weights, with one all-reduce forward and one backward per step. The two
are interleaved ``--repeats`` times; each row reports the median step time of its run (tp: the
slowest rank). On a 2-core machine shared with other work the ratio mostly measures the
all-reduces of (batch, dim) activations against halved matmuls; it is noisy, say so when quoting it.

The torch rows (``--suite torch``, see ``_tp_torch.py``) time one transformer block of transformers GPT-2
and of Llama (``--torch-embd`` 1024, 16 heads, MLP 4x, ``--torch-seq`` 256 tokens x ``--torch-batch`` 4,
float32, AdamW) dense on one process, under ``pp.parallelize`` on tp = 2, and (Llama) under torch's own
``parallelize_module`` (ColwiseParallel / RowwiseParallel over gloo DTensors) on tp = 2: ``--torch-threads
default`` each at its defaults (dense torch: one intra-op thread per core; tp ranks: one, as torchrun sets),
``1`` one thread per process, ``both`` (default) the two interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from paramplane.benchmarks._jsonl import emit
from paramplane.local_world import json_lines, run_world

THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TP = 2


def _steps(model: Any, x: np.ndarray, steps: int, barrier: Any = None) -> float:
    from paramplane.optim import SGD

    opt = SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps + 1):  # the first step warms up
        if barrier is not None:
            barrier()
        t = time.perf_counter()
        y = model.forward(x)
        model.backward(np.ones_like(y) / y.size)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:]))


def worker(args: argparse.Namespace) -> None:
    from paramplane.nn import GELU, Linear, Sequential

    x = np.random.default_rng(0).standard_normal((args.batch, args.dim)).astype(np.float32)
    if args.worker == "dense":
        model = Sequential(Linear(args.dim, args.hidden, rng=5), GELU(), Linear(args.hidden, args.dim, rng=6))
        print(json.dumps({"step_s": _steps(model, x, args.steps)}), flush=True)
        return
    import paramplane as pp

    world = pp.init()
    try:
        tp = pp.Mesh(world, tp=TP).group("tp")
        model = Sequential(
            pp.ColumnParallelLinear(args.dim, args.hidden, tp, rng=5),
            GELU(),
            pp.RowParallelLinear(args.hidden, args.dim, tp, rng=6),
        )
        print(json.dumps({"step_s": _steps(model, x, args.steps, tp.barrier)}), flush=True)
        tp.barrier()
    finally:
        world.shutdown()


def _run(kind: str, args: argparse.Namespace) -> float:
    cmd = [sys.executable, __file__, "--worker", kind]
    for flag in ("dim", "hidden", "batch", "steps"):
        cmd += [f"--{flag}", str(getattr(args, flag))]
    if kind == "dense":
        out = subprocess.run(
            cmd, env=dict(os.environ, **THREADS), capture_output=True, text=True, timeout=1800
        )
        if out.returncode:
            raise RuntimeError(f"dense benchmark failed: {out.stderr[-2000:]}")
        return float(json.loads(out.stdout.strip().splitlines()[-1])["step_s"])
    ranks = json_lines(
        run_world(TP, lambda _r: cmd, env=dict(os.environ, **THREADS), timeout_s=1800.0, stderr="inherit"),
        "tensor-parallel benchmark",
    )
    return max(float(r["step_s"]) for r in ranks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--suite", choices=("numpy", "torch", "all"), default="all")
    parser.add_argument("--torch-embd", type=int, default=1024)
    parser.add_argument("--torch-seq", type=int, default=256)
    parser.add_argument("--torch-batch", type=int, default=4)
    parser.add_argument(
        "--torch-threads",
        choices=("default", "1", "both"),
        default="both",
        help="torch rows: each at its defaults (dense: torch's threads, tp ranks: 1 as torchrun), or 1 each",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=("dense", "tp"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    lines: list[str] = []
    if args.suite in ("torch", "all"):
        from paramplane.benchmarks import _tp_torch

        modes = ("default", "1") if args.torch_threads == "both" else (args.torch_threads,)
        lines += _tp_torch.rows(
            args.torch_embd, args.torch_seq, args.torch_batch, args.steps, args.repeats, modes
        )
    for repeat in range(args.repeats if args.suite != "torch" else 0):
        dense = _run("dense", args)
        tp = _run("tp", args)
        shape = {"dim": args.dim, "hidden": args.hidden, "batch": args.batch, "dtype": "float32"}
        lines.append(
            json.dumps(
                {
                    "bench": "tensor_parallel",
                    "repeat": repeat,
                    **shape,
                    "tp": TP,
                    "dense_step_s": dense,
                    "tp_step_s": tp,
                    "tp_over_dense": tp / dense,
                    "note": "2-core machine shared with other jobs: noisy",
                }
            )
        )
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
