"""``pp.DDP`` over a model with expert-parallel experts (``pp.parallelize(..., {"*experts": "experts"})``).

Each rank of the DDP group holds other experts (``tp_shard.experts`` over the same group), and an expert's
gradient on its rank already sums the contributions of every rank's tokens (``tp_torch/experts.py``). So DDP
neither broadcasts these parameters at wrap time nor all-reduces their gradients: with ``reduce_op="mean"``
each backward's contribution is divided by the group's size (a gradient hook), which gives the gradient of the
mean of the ranks' losses, as the all-reduced parameters get. ``clip_grad_norm_`` sums the experts' squares
over the group (torch's helper would clip each rank by its own norm, and the replicated parameters would drift
apart).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.torch_params import clip_grads_to, to_array, torch_stream

__all__ = ["clip_grad_norm", "expert_pieces", "scale_expert_grads"]


def _expert_spec(p: Any) -> Any:
    spec = getattr(getattr(p, "tensor", None), "tp_shard", None)
    return spec if spec is not None and getattr(spec, "experts", False) else None


def expert_pieces(params: Sequence[Any], group: ProcessGroup) -> set[int]:
    """Indices of ``params`` (``TorchParam``s) that are expert-parallel pieces over ``group``; ValueError for
    expert pieces over another group (their replicas would need a reduction DDP does not make)."""
    out = set()
    for i, p in enumerate(params):
        spec = _expert_spec(p)
        if spec is None:
            continue
        if tuple(spec.group.ranks) != tuple(group.ranks):
            raise ValueError(
                f"parameter {p.name!r} is split over expert-parallel group '{spec.group.name}' (ranks "
                f"{list(spec.group.ranks)}), and pp.DDP reduces over '{group.name}' (ranks {list(group.ranks)}): "
                "wrap the model in pp.DDP over the expert-parallel group itself"
            )
        out.add(i)
    return out


def scale_expert_grads(params: Sequence[Any], group: ProcessGroup, reduce_op: str) -> list[Any]:
    """For ``"mean"``: each gradient contribution of the expert pieces ``params`` divided by the group's size;
    the hooks' handles."""
    if reduce_op != "mean" or group.size == 1:
        return []
    n = float(group.size)
    return [p.tensor.register_hook(lambda g: g / n) for p in params if p.requires_grad]


def clip_grad_norm(
    replicated: Sequence[Any], experts: Sequence[Any], group: ProcessGroup, max_norm: float, norm_type: float
) -> Any:
    """Scale the gradients of ``replicated`` (equal on every rank) and ``experts`` (each rank's own) tensors so
    that the whole model's gradient norm is at most ``max_norm``; returns that norm (a float64 tensor, equal
    on every rank)."""
    import torch

    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm!r}")
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type!r}")
    grads = [t.grad for t in (*replicated, *experts) if t.grad is not None]
    mine = [t.grad.detach().double() for t in experts if t.grad is not None]
    rest = [t.grad.detach().double() for t in replicated if t.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == math.inf:
        own = (
            torch.stack([g.abs().max() for g in mine]).max() if mine else torch.zeros((), dtype=torch.float64)
        )
        shared = (
            torch.stack([g.abs().max() for g in rest]).max() if rest else torch.zeros((), dtype=torch.float64)
        )
        part = own.reshape(1).to(device).contiguous()
        with torch_stream(part):
            group.all_reduce(to_array(part, "a gradient norm"), "max")
        norm = torch.maximum(part[0], shared.to(device))
    else:
        own = sum((g.pow(2).sum() for g in mine), torch.zeros((), dtype=torch.float64))
        shared = sum((g.pow(2).sum() for g in rest), torch.zeros((), dtype=torch.float64))
        part = own.reshape(1).to(device).contiguous()
        with torch_stream(part):
            group.all_reduce(to_array(part, "a squared gradient norm"), "sum")
        norm = (part[0] + shared.to(device)).sqrt()
    clip_grads_to(grads, norm, max_norm)
    return norm
