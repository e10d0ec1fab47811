"""Vocabulary-parallel cross-entropy (Megatron's ``tensor_parallel/cross_entropy.py``).

Each rank holds the logits of its slice of the vocabulary (a ``ColwiseParallel`` head without
``gather_output``: rank r holds classes ``[r*V/tp, (r+1)*V/tp)``). The loss needs three reductions over the
group, never the full logits: the maximum (for a stable softmax), then in one all-reduce the target's logit
(only the rank owning the target contributes) and the sum of exponentials. Backward is local:
``softmax - onehot(target)`` on this rank's slice, scaled by the incoming gradient.
"""

from __future__ import annotations

from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.tp_torch.comm import all_reduce_

__all__ = ["vocab_parallel_cross_entropy"]

_FN: list[Any] = []


def _function() -> Any:
    if _FN:
        return _FN[0]
    import torch

    class VocabParallelCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, logits: Any, target: Any, group: ProcessGroup, ignore_index: int) -> Any:
            x = logits.detach()
            rows = x.shape[-1]
            lo = group.rank * rows
            top = x.max(dim=-1).values.contiguous()
            all_reduce_(top, group, "max")
            x = x - top.unsqueeze(-1)
            valid = target != ignore_index
            mine = valid & (target >= lo) & (target < lo + rows)
            index = (target - lo).masked_fill(~mine, 0)
            picked = x.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0)
            e = x.exp()
            sums = torch.stack([picked, e.sum(dim=-1)]).contiguous()
            all_reduce_(sums, group, "sum")
            loss = (torch.log(sums[1]) - sums[0]).masked_fill(~valid, 0)
            e.div_(sums[1].unsqueeze(-1))
            ctx.save_for_backward(e, index, mine, valid)
            return loss

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            softmax, index, mine, valid = ctx.saved_tensors
            g = softmax.clone()
            g.scatter_add_(-1, index.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
            g.mul_((grad * valid.to(grad.dtype)).unsqueeze(-1))
            return g, None, None, None

    _FN.append(VocabParallelCE)
    return VocabParallelCE


def vocab_parallel_cross_entropy(
    logits_shard: Any,
    target: Any,
    group: ProcessGroup,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Any:
    """``torch.nn.functional.cross_entropy(full_logits, target)`` from this rank's vocabulary slice of the
    logits, shape ``(..., V/tp)``, and the class indices ``target``, shape ``(...)``; the full logits never
    exist on one rank. ``ignore_index`` targets count for nothing (``"mean"`` averages over the others, as
    torch's); ``reduction``: ``"mean"``, ``"sum"`` or ``"none"`` (per-position losses, shape ``(...)``).
    Every rank of ``group`` calls it with the same ``target``."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if tuple(target.shape) != tuple(logits_shard.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits' leading shape "
            f"{tuple(logits_shard.shape[:-1])} (logits are (..., vocab/tp))"
        )
    if target.dtype.is_floating_point:
        raise ValueError(f"target must hold class indices (an integer tensor), got {target.dtype}")
    if not isinstance(group, ProcessGroup):
        raise ValueError(f"vocab_parallel_cross_entropy needs a ProcessGroup, got {type(group).__name__}")
    loss = _function().apply(logits_shard, target, group, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
