"""Frozen parameters sharded with ``use_orig_params``: when a unit that holds some may reshard in backward.

A unit whose parameters all train is resharded when the last of their gradients is accumulated: nothing reads
the unit after that (every node that reads a parameter on the way to a trainable one's gradient runs before
that gradient's accumulation). A frozen parameter has no gradient to wait for, and its value is still read by
the backward towards its module's inputs (a LoRA base weight: dX = dY·Wᵀ) after the trainable parameters'
gradients may be done. So a unit that holds frozen parameters reshards once its trainable gradients are done
and the gradients of its module's inputs are computed for every forward that used it (``pending_inputs``
counts those still to come): an autograd function around the module's inputs, as FSDP2's post-backward
function, says when. A root unit, and any unit still gathered then, reshards at the end of the backward
(``Reducer.finish``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from paramplane.parallel.fsdp.units import FlatUnit

__all__ = ["holds_frozen", "watch_inputs"]

_FUNCTION: Any = None


def holds_frozen(unit: FlatUnit) -> bool:
    """Whether some of ``unit``'s parameters are frozen (set by the torch adapter)."""
    return int(unit.extra.get("num_trainable", len(unit.params))) < len(unit.params)


def _function() -> Any:
    """An identity on tensors whose backward calls a callback once every input's gradient is computed."""
    global _FUNCTION
    if _FUNCTION is None:
        import torch

        class InputsDone(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, callback: Callable[[], None], *tensors: Any) -> Any:
                ctx.callback = callback
                return tuple(t.view_as(t) for t in tensors)

            @staticmethod
            def backward(ctx: Any, *grads: Any) -> Any:
                ctx.callback()
                return (None, *grads)

        _FUNCTION = InputsDone
    return _FUNCTION


def watch_inputs(module: Any, unit: FlatUnit, inputs_done: Callable[[FlatUnit], None]) -> None:
    """Call ``inputs_done(unit)`` once the gradients of ``module``'s inputs (those of a forward that require
    one) are computed, for each such forward; ``unit.extra["pending_inputs"]`` counts the forwards waiting."""
    import torch

    def before(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        if not torch.is_grad_enabled():
            return None
        keys = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
        names = [k for k, v in kwargs.items() if torch.is_tensor(v) and v.requires_grad]
        if not keys and not names:
            return None
        unit.extra["pending_inputs"] = unit.extra.get("pending_inputs", 0) + 1
        out = _function().apply(
            lambda: inputs_done(unit), *(args[i] for i in keys), *(kwargs[k] for k in names)
        )
        new_args, new_kwargs = list(args), dict(kwargs)
        for i, t in zip(keys, out[: len(keys)], strict=True):
            new_args[i] = t
        for k, t in zip(names, out[len(keys) :], strict=True):
            new_kwargs[k] = t
        return tuple(new_args), new_kwargs

    module.register_forward_pre_hook(before, with_kwargs=True)
