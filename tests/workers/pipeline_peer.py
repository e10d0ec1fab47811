"""``pp.Pipeline`` against torch's own ``torch.distributed.pipelining`` on the same stages (gloo CPU group).

World 2 (pp 2): every rank builds the same transformers GPT-2 (float64, seed 0, tied embedding and head) twice
and cuts both with ``pp.pipeline_split``. One copy runs under ``pp.Pipeline``, the other under torch's
``PipelineStage`` with the matching schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``
with 2 ranks x 2 chunks), the same microbatches, the same attention mask (passed to every rank's ``step``, which
torch hands to every stage) and torch's defaults (``scale_grads=True``). torch's schedules leave tied weights to
the user: the torch side sums the tied embedding/head gradient over its two stages with a gloo all-reduce after
each step, as ``pp.Pipeline`` does itself. Both train with AdamW; each step's per-microbatch losses, every
gradient and the final parameters must agree within 1e-12 relative (they run the same float64 operations on
the same microbatches; only the order of the gradient sums may differ). Then ``pipeline_tuple.py``'s stages,
which pass a tuple of two float64 tensors and an int64 one, under every schedule on both sides: the losses and
gradients of two steps agree within 1e-12; and transformers' Llama cut by hand into stages passing
``(hidden_states, cos, sin)`` (``pipeline_tuple.llama_stages``), 1F1B: the same.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank

import paramplane as pp

TOL = 1e-12
STEPS, MICROBATCHES, PER_MB = 2, 4, 2
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}


def stages_of(rank: int, p: int, v: int) -> list[Any]:
    model = tm.build("gpt2", layers=2 * p * v)
    stages = pp.pipeline_split(model, [2 * s for s in range(1, p * v)])
    return stages[rank::p]


def compare(world: Any, rep: Report, schedule: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    g = world.group
    p, rank = g.size, g.rank
    v = 2 if schedule == "interleaved_1f1b" else 1
    ours, theirs = stages_of(rank, p, v), stages_of(rank, p, v)
    pipe = pp.Pipeline(ours if v > 1 else ours[0], g, schedule, MICROBATCHES, loss_fn=pp.causal_lm_loss)
    torch_stages = [
        pipelining.PipelineStage(s, rank + c * p, p * v, torch.device("cpu")) for c, s in enumerate(theirs)
    ]
    peer = getattr(pipelining, TORCH_SCHEDULES[schedule])(
        torch_stages if v > 1 else torch_stages[0], MICROBATCHES, loss_fn=pp.causal_lm_loss
    )
    tied = [dict(s.named_parameters())[name] for s in theirs for name, _ in s._paramplane_stage.tied.values()]
    rep.check(f"{schedule}: a tied weight on this rank", len(tied) == 1)
    opts = [
        torch.optim.AdamW([q for s in side for q in s.parameters()], lr=1e-2, weight_decay=0.1)
        for side in (ours, theirs)
    ]
    last = rank == (p * v - 1) % p
    for step in range(STEPS):
        b = tm.left_padded_batch(step, MICROBATCHES * PER_MB, PER_MB)
        mask = b["attention_mask"]
        got = pipe.step(
            b["input_ids"] if rank == 0 else None,
            target=b["labels"] if last else None,
            attention_mask=mask,
        )
        want: list[Any] = []
        args = (b["input_ids"],) if rank == 0 else ()
        if last:
            peer.step(*args, target=b["labels"], losses=want, attention_mask=mask)
        else:
            peer.step(*args, attention_mask=mask)
        for t in tied:  # torch's schedules leave tied weights to the user (Megatron's embedding all-reduce)
            dist.all_reduce(t.grad)
        if last:
            assert got is not None
            rep.close(f"{schedule} losses {step}", np.array(got), np.array([float(x) for x in want]), TOL)
        theirs_params = {n: q for s in theirs for n, q in s.named_parameters()}
        for n, q in sorted((n, q) for s in ours for n, q in s.named_parameters()):
            assert q.grad is not None and theirs_params[n].grad is not None, n
            rep.close(f"{schedule} grad {n} {step}", q.grad.numpy(), theirs_params[n].grad.numpy(), TOL)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    want_state = {n: t for s in theirs for n, t in s.state_dict().items()}
    for s in ours:
        for n, t in s.state_dict().items():
            rep.close(f"{schedule} final {n}", t.numpy(), want_state[n].numpy(), TOL)


def compare_tuples(world: Any, rep: Report, schedule: str) -> None:
    """Stages that pass ``(hidden, residual, ids)`` (``pipeline_tuple.py``'s): the same under both runtimes."""
    import torch
    from pipeline_tuple import batch, stage_modules
    from torch.distributed import pipelining

    g = world.group
    p, rank = g.size, g.rank
    v = 2 if schedule == "interleaved_1f1b" else 1
    ours, theirs = stage_modules(p * v)[rank::p], stage_modules(p * v)[rank::p]
    loss_fn = torch.nn.functional.mse_loss
    pipe = pp.Pipeline(ours if v > 1 else ours[0], g, schedule, MICROBATCHES, loss_fn=loss_fn)
    torch_stages = [
        pipelining.PipelineStage(s, rank + c * p, p * v, torch.device("cpu")) for c, s in enumerate(theirs)
    ]
    peer = getattr(pipelining, TORCH_SCHEDULES[schedule])(
        torch_stages if v > 1 else torch_stages[0], MICROBATCHES, loss_fn=loss_fn
    )
    last = rank == (p * v - 1) % p
    for step in range(STEPS):
        x, y = batch(step)
        got = pipe.step(x if rank == 0 else None, target=y if last else None)
        want: list[Any] = []
        args = x if rank == 0 else ()
        if last:
            peer.step(*args, target=y, losses=want)
        else:
            peer.step(*args)
        if last:
            assert got is not None
            rep.close(
                f"tuples {schedule} losses {step}", np.array(got), np.array([float(w) for w in want]), TOL
            )
        for s_ours, s_theirs in zip(ours, theirs, strict=True):
            for (n, q), (_, t) in zip(s_ours.named_parameters(), s_theirs.named_parameters(), strict=True):
                assert q.grad is not None and t.grad is not None, n
                rep.close(f"tuples {schedule} grad {n} {step}", q.grad.numpy(), t.grad.numpy(), TOL)
                q.grad = t.grad = None


def compare_llama_tuples(world: Any, rep: Report, schedule: str) -> None:
    """transformers' Llama cut by hand into stages passing ``(hidden_states, cos, sin)`` (``pipeline_tuple.py``):
    losses and gradients under both runtimes (the tied embedding/head summed over the two stages on each side)."""
    import torch
    import torch.distributed as dist
    from pipeline_tuple import llama_stages
    from torch.distributed import pipelining

    g = world.group
    p, rank = g.size, g.rank
    ours_model, theirs_model = tm.build("llama", layers=2), tm.build("llama", layers=2)
    ours, theirs = llama_stages(ours_model)[rank], llama_stages(theirs_model)[rank]
    pipe = pp.Pipeline(ours, g, schedule, MICROBATCHES, loss_fn=pp.causal_lm_loss)
    stage = pipelining.PipelineStage(theirs, rank, p, torch.device("cpu"))
    peer = getattr(pipelining, TORCH_SCHEDULES[schedule])(stage, MICROBATCHES, loss_fn=pp.causal_lm_loss)
    last = rank == p - 1
    for step in range(STEPS):
        b = tm.left_padded_batch(step, MICROBATCHES * PER_MB, PER_MB)
        got = pipe.step(b["input_ids"] if rank == 0 else None, target=b["labels"] if last else None)
        want: list[Any] = []
        args = (b["input_ids"],) if rank == 0 else ()
        if last:
            peer.step(*args, target=b["labels"], losses=want)
        else:
            peer.step(*args)
        g.all_reduce(ours_model.lm_head.weight.grad)
        dist.all_reduce(theirs_model.lm_head.weight.grad)
        if last:
            assert got is not None
            rep.close(
                f"llama {schedule} losses {step}", np.array(got), np.array([float(w) for w in want]), TOL
            )
        for (n, q), (_, t) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
            assert q.grad is not None and t.grad is not None, n
            rep.close(f"llama {schedule} grad {n} {step}", q.grad.numpy(), t.grad.numpy(), TOL)
            q.grad = t.grad = None


def scenario(world: Any, rep: Report) -> None:
    dist = tm.init_gloo(world)
    try:
        for schedule in TORCH_SCHEDULES:
            compare(world, rep, schedule)
        for schedule in TORCH_SCHEDULES:
            compare_tuples(world, rep, schedule)
        compare_llama_tuples(world, rep, "1f1b")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(scenario)
