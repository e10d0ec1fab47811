"""DiLoCo's state for ``pp.checkpoint``: ``last`` per parameter (FSDP shards as pieces of the original
parameters, so they reshard), the outer optimizer's state and the step count."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from paramplane.optim import SGD, AdamW
from paramplane.optim.optimizer import Optimizer
from paramplane.parallel.torch_params import to_array

if TYPE_CHECKING:
    from paramplane.parallel.diloco import DiLoCo


def materialize_outer(d: DiLoCo) -> None:
    """Give the outer optimizer (zero) state for every parameter, so saved and loaded keys agree: zero
    momentum (and AdamW's zero moments at step 0) steps exactly as no state does."""
    opt = d.outer_optimizer
    if isinstance(opt, SGD) and opt.momentum > 0 and opt.dampening == 0:
        for i in range(len(opt.params)):
            opt.ensure_state(i, ["momentum_buffer"], {})
    elif isinstance(opt, AdamW) and not getattr(opt, "amsgrad", False):
        for i in range(len(opt.params)):
            opt.ensure_state(i, ["exp_avg", "exp_avg_sq"], {"step": 0})
    elif not isinstance(opt, Optimizer):
        import torch

        group = opt.param_groups[0] if len(opt.param_groups) == 1 else None
        if not isinstance(opt, torch.optim.SGD) or group is None or group["dampening"] != 0:
            raise ValueError(
                "pp.checkpoint saves a torch outer optimizer when it is one torch.optim.SGD param group "
                "without dampening; use DiLoCo.state_dict() for others"
            )
        if group["momentum"] > 0:
            for p in d.params:
                opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p.detach()))


def _pieces(d: DiLoCo, prefix: str, i: int, array: Any) -> dict[str, Any]:
    layout = d._layouts[i]
    if layout is None:
        return {f"{prefix}{d.keys[i]}": array}
    views = layout.views if hasattr(layout, "views") else layout
    return {f"{prefix}{name}": piece for name, piece in views(array.reshape(-1)).items()}


def sharded_state_dict(d: DiLoCo) -> dict[str, Any]:
    """For ``pp.checkpoint``: ``step``, ``last.<param>`` and ``outer.<key>`` (live views: a loader writes
    into them). FSDP shards appear as pieces of the original parameters, so they reshard."""
    d.finish()
    materialize_outer(d)
    out: dict[str, Any] = {"step": d.step}
    for i in range(len(d.params)):
        out.update(_pieces(d, "last.", i, d.last[i]))
    opt = d.outer_optimizer
    if isinstance(opt, Optimizer):
        out.update({f"outer.{k}": v for k, v in opt.sharded_state_dict().items()})
    else:
        for i, p in enumerate(d.params):
            buf = opt.state[p].get("momentum_buffer")
            if buf is not None:
                out.update(_pieces(d, "outer.momentum_buffer.", i, to_array(buf, d.keys[i])))
    return out
