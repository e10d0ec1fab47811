"""The torch rows of ``tensor_parallel.py``: one transformer block, dense on one process against tp = 2.

    python benchmarks/_tp_torch.py --worker {dense,pp,torch} --model {gpt2,llama} ...   (started by rows())

A step is zero_grad, forward of the block on (batch, seq, embd) float32 activations, backward of the mean of
its output, AdamW step; the median of ``steps`` steps after one warm-up step (tp rows: the slowest rank's).
Threads (``--torch-threads``): ``default`` is each at torch's own defaults, the dense process with torch's
default intra-op threads (one per core: both cores on a 2-core machine) and every tp rank with one, as
``torchrun`` sets ``OMP_NUM_THREADS=1`` for several processes per host; ``1`` is one thread per process for
all (tp 2 then has twice the dense row's cores). Each row names the threads every process ran with. ``pp``: ``pp.parallelize`` with ``pp.tp_plan_for`` (GPT-2's fused c_attn split
by heads); ``torch``: torch's ``parallelize_module`` with ColwiseParallel / RowwiseParallel on the Llama
layer's q/k/v/gate/up and o/down projections over a gloo device mesh (GPT-2's fused c_attn is not
head-aligned under torch's plain ColwiseParallel, so torch's peer row is Llama only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

from paramplane.local_world import json_lines, run_world

THREADS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TP = 2


def _block(model: str, embd: int, seq: int) -> tuple[Any, dict[str, Any]]:
    """A fresh block (seed 0, float32) and the keyword arguments its forward needs besides the input."""
    import torch

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.manual_seed(0)
    heads = embd // 64
    if model == "gpt2":
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        gpt = GPT2Config(n_embd=embd, n_head=heads, n_positions=seq, attn_pdrop=0.0, resid_pdrop=0.0)
        return GPT2Block(gpt, layer_idx=0), {}
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(
        hidden_size=embd, intermediate_size=4 * embd, num_attention_heads=heads, num_key_value_heads=heads
    )
    cfg._attn_implementation = "sdpa"
    rope = LlamaRotaryEmbedding(cfg)
    pos = torch.arange(seq).unsqueeze(0)
    cos_sin = rope(torch.zeros(1, seq, embd), pos)
    return LlamaDecoderLayer(cfg, layer_idx=0), {"position_embeddings": cos_sin, "position_ids": pos}


def _time(block: Any, kw: dict[str, Any], x: Any, steps: int, barrier: Any) -> float:
    import torch

    opt = torch.optim.AdamW(block.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 1):
        barrier()
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = block(x, **kw)
        out = out[0] if isinstance(out, tuple) else out
        out.float().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def worker(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    block, kw = _block(args.model, args.embd, args.seq)
    x = torch.randn(args.batch, args.seq, args.embd, generator=torch.Generator().manual_seed(1))
    if args.worker == "dense":
        step = _time(block, kw, x, args.steps, lambda: None)
        print(json.dumps({"step_s": step, "threads": torch.get_num_threads()}), flush=True)
        return
    if args.worker == "torch":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=TP)
        mesh = init_device_mesh("cpu", (TP,))
        col, row = ColwiseParallel(), RowwiseParallel()
        plan: dict[str, Any] = {f"self_attn.{p}_proj": col for p in "qkv"} | {"self_attn.o_proj": row}
        plan |= {"mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row}
        parallelize_module(block, mesh, plan)
        step = _time(block, kw, x, args.steps, dist.barrier)
        dist.destroy_process_group()
        print(json.dumps({"step_s": step, "threads": torch.get_num_threads()}), flush=True)
        return
    import paramplane as pp

    world = pp.init()
    try:
        tp = pp.Mesh(world, tp=TP).group("tp")
        pp.parallelize(block, tp, pp.tp_plan_for(block))
        step = _time(block, kw, x, args.steps, tp.barrier)
        print(json.dumps({"step_s": step, "threads": torch.get_num_threads()}), flush=True)
        tp.barrier()
    finally:
        world.shutdown()


def _run(kind: str, model: str, sizes: dict[str, int], threads: str) -> tuple[float, int]:
    """The step time (tp: the slowest rank's) and the threads each process ran with."""
    cmd = [sys.executable, __file__, "--worker", kind, "--model", model]
    for flag, value in sizes.items():
        cmd += [f"--{flag}", str(value)]
    own_default = threads == "default" and kind == "dense"
    env = {k: v for k, v in os.environ.items() if k not in THREADS}
    env.update({} if own_default else THREADS)
    cmd += ["--threads", "0" if own_default else "1"]
    if kind == "dense":
        (row,) = json_lines(
            run_world(1, lambda _r: cmd, env=env, coordinator=False, timeout_s=1800.0, stderr="inherit"),
            "dense torch block",
        )
        return float(row["step_s"]), int(row["threads"])
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ranks = json_lines(
            run_world(
                TP,
                lambda r: [*cmd, "--rank", str(r), "--store", store],
                env=env,
                coordinator=kind == "pp",
                timeout_s=1800.0,
                stderr="inherit",
            ),
            f"{kind} tensor-parallel torch block",
        )
    return max(float(r["step_s"]) for r in ranks), max(int(r["threads"]) for r in ranks)


def rows(
    embd: int, seq: int, batch: int, steps: int, repeats: int, threads: tuple[str, ...] = ("default", "1")
) -> list[str]:
    """One JSON line per model, thread setting and repeat (interleaved): dense, pp.parallelize and (Llama)
    torch's parallelize_module."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("torch rows skipped: torch and transformers are not installed", file=sys.stderr)
        return []
    sizes = {"embd": embd, "seq": seq, "batch": batch, "steps": steps}
    lines = []
    for repeat in range(repeats):
        for mode in threads:
            for model in ("gpt2", "llama"):
                load_before = os.getloadavg()[0]
                dense, dense_threads = _run("dense", model, sizes, mode)
                mine, tp_threads = _run("pp", model, sizes, mode)
                row: dict[str, Any] = {
                    "bench": "tensor_parallel_torch",
                    "model": f"{model} block",
                    "repeat": repeat,
                    **{k: v for k, v in sizes.items() if k != "steps"},
                    "heads": embd // 64,
                    "dtype": "float32",
                    "tp": TP,
                    "threads": mode,
                    "dense_threads": dense_threads,
                    "tp_threads_per_rank": tp_threads,
                    "cpus": os.cpu_count(),
                    "dense_step_s": dense,
                    "pp_tp_step_s": mine,
                    "pp_over_dense": mine / dense,
                }
                if model == "llama":
                    theirs, _ = _run("torch", model, sizes, mode)
                    row.update(
                        torch_tp_step_s=theirs, torch_over_dense=theirs / dense, pp_over_torch=mine / theirs
                    )
                row["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
                lines.append(json.dumps(row))
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", choices=("dense", "pp", "torch"), required=True)
    parser.add_argument("--model", choices=("gpt2", "llama"), required=True)
    for flag in ("embd", "seq", "batch", "steps"):
        parser.add_argument(f"--{flag}", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--store", default="")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads; 0: torch's default")
    worker(parser.parse_args())
