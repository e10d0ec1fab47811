"""Expert parallel on a torch mixture of experts: step time and memory per rank against replicated experts.

    python benchmarks/expert_parallel.py [--world 2] [--experts 8] [--hidden 256] [--intermediate 512]
                                         [--layers 2] [--seq 128] [--batch 4] [--steps 5] [--repeats 2]
                                         [--out benchmarks/results/expert_parallel.jsonl]

The same transformers Mixtral (``--experts`` experts, 2 per token, float32, the model's default expert code)
trains ``--steps`` AdamW steps after a warm-up on ``--world`` ranks, each on its own ``--batch`` sequences of
``--seq`` tokens, three ways (interleaved ``--repeats`` times): ``pp-ep``, the experts split over the ranks
(``pp.parallelize(model, group, {"*mlp.experts": "experts"})``) under ``pp.DDP``; ``pp-ddp``, every rank holding
every expert under ``pp.DDP``; ``torch-ddp``, the same under torch's ``DistributedDataParallel`` over gloo.
Each row: the median step time (the slowest rank's), the parameters and optimizer state a rank holds, and its
peak resident memory (``ru_maxrss``, the interpreter and torch included). One intra-op thread per process for
all three (what ``torchrun`` sets for several processes on a host). ``ep_over_ddp`` / ``ep_over_torch``: ours
with experts split, over each replicated run of the same repeat.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paramplane.benchmarks._jsonl import emit
from paramplane.local_world import json_lines, run_world

THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
IMPLS = ("pp-ep", "pp-ddp", "torch-ddp")
SIZES = ("experts", "hidden", "intermediate", "layers", "seq", "batch", "steps")


def _model(args: argparse.Namespace) -> Any:
    import warnings

    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=args.experts,
        num_experts_per_tok=2,
        max_position_embeddings=args.seq,
    )
    return MixtralForCausalLM(cfg).float()


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    rank = int(os.environ["PARAMPLANE_RANK"])
    model = _model(args)
    world = None
    barrier: Callable[[], Any]
    if args.worker == "torch-ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=args.world)
        wrapped: Any = torch.nn.parallel.DistributedDataParallel(model)
        barrier = dist.barrier
    else:
        import paramplane as pp

        world = pp.init()
        if args.worker == "pp-ep":
            pp.parallelize(model, world.group, {"*mlp.experts": "experts"})
        wrapped = pp.DDP(model, world.group)
        barrier = world.group.barrier
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(rank))
    times = []
    for _ in range(args.steps + 1):  # the first step warms up
        barrier()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        wrapped(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    held = sum(p.numel() for p in model.parameters())
    state = sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    row = {
        "step_s": statistics.median(times[1:]),
        "params_per_rank": held,
        "optim_state_per_rank": state,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    barrier()
    if world is not None:
        world.shutdown()
    else:
        import torch.distributed as dist

        dist.destroy_process_group()
    print(json.dumps(row), flush=True)


def _run(impl: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", impl, "--world", str(args.world)]
    for flag in SIZES:
        cmd += [f"--{flag}", str(getattr(args, flag))]
    env = {**os.environ, **THREADS}
    with tempfile.TemporaryDirectory(prefix="paramplane-ep-") as tmp:
        ranks = json_lines(
            run_world(
                args.world,
                lambda _r: [*cmd, "--store", os.path.join(tmp, "store")],
                env=env,
                coordinator=impl != "torch-ddp",
                timeout_s=1800.0,
                stderr="inherit",
            ),
            f"expert parallel benchmark ({impl})",
        )
    return {
        "step_s": max(r["step_s"] for r in ranks),
        "params_per_rank": max(r["params_per_rank"] for r in ranks),
        "optim_state_per_rank": max(r["optim_state_per_rank"] for r in ranks),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
    }


def rows(args: argparse.Namespace) -> list[str]:
    lines = []
    for repeat in range(args.repeats):
        load = round(os.getloadavg()[0], 2)
        got = {impl: _run(impl, args) for impl in IMPLS}
        ep = got["pp-ep"]["step_s"]
        for impl, row in got.items():
            line: dict[str, Any] = {
                "bench": "expert_parallel",
                "impl": impl,
                "model": "mixtral",
                "world": args.world,
                **{k: getattr(args, k) for k in SIZES if k != "steps"},
                "dtype": "float32",
                "threads_per_rank": 1,
                **row,
                "repeat": repeat,
                "loadavg_1m_before": load,
            }
            if impl == "pp-ep":
                line["ep_over_ddp"] = ep / got["pp-ddp"]["step_s"]
                line["ep_over_torch"] = ep / got["torch-ddp"]["step_s"]
            lines.append(json.dumps(line))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag in ("world", *SIZES, "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.world < 2:
        parser.error("--world must be at least 2 (experts split over the ranks)")
    if args.experts % args.world:
        parser.error(f"--experts ({args.experts}) must divide by --world ({args.world})")
    if args.worker:
        worker(args)
        return 0
    emit(rows(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
