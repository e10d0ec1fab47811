"""FSDP2's ``FSDPModule`` methods that training loops call, on pp.FSDP: ``unshard()`` / ``reshard()``,
``set_gradient_divide_factor(f)``, ``set_reshard_after_forward``, and the ones that only trade memory or
overlap for speed there (``set_reshard_after_backward``, ``set_is_last_backward``,
``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``), accepted so FSDP2 loops (its gradient
accumulation recipe: ``set_requires_gradient_sync(False)`` with ``set_reshard_after_backward(False)``) run
unchanged, with the same results. Each is assigned as a method in ``wrapper.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramplane.parallel.fsdp.wrapper import FSDP

__all__ = [
    "UnshardHandle",
    "reshard",
    "set_gradient_divide_factor",
    "set_is_last_backward",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "unshard",
]


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def set_gradient_divide_factor(self: FSDP, factor: float) -> None:
    """FSDP2's ``set_gradient_divide_factor``: the reduced gradients are the ranks' sum divided by ``factor``
    (default: the number of ranks, a mean; 1.0: the sum), from the next synchronised backward on."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(f"the gradient divide factor must be a positive number, got {factor!r}")
    self._reducer.divide_factor = float(factor)


def set_reshard_after_forward(self: FSDP, reshard_after_forward: bool, recurse: bool = True) -> None:
    """FSDP2's ``set_reshard_after_forward``: False keeps each unit's parameters gathered from its forward to
    its backward (shard_grad_op's memory for one all-gather less per unit), True frees them after the forward;
    from the next forward on, for every unit (``recurse`` is FSDP2's: here the units are one wrapper's)."""
    del recurse
    self.reshard_after_forward = _flag("reshard_after_forward", reshard_after_forward)


def set_reshard_after_backward(self: FSDP, reshard_after_backward: bool, *, recurse: bool = True) -> None:
    """FSDP2's ``set_reshard_after_backward``: accepted, and pp.FSDP reshards after every backward whatever
    the value (False in FSDP2 keeps parameters gathered between accumulation steps, for memory: the results
    are the same; here the next forward gathers them again)."""
    del recurse
    _flag("reshard_after_backward", reshard_after_backward)


def set_is_last_backward(self: FSDP, is_last_backward: bool) -> None:
    """FSDP2's ``set_is_last_backward``: accepted; pp.FSDP waits for a synchronised backward's reductions when
    that backward ends (as FSDP2 does on its last one), and a backward under ``set_requires_gradient_sync(
    False)`` reduces nothing."""
    _flag("is_last_backward", is_last_backward)


def set_modules_to_forward_prefetch(self: FSDP, modules: Sequence[Any]) -> None:
    """FSDP2's explicit forward prefetch: accepted; pp.FSDP prefetches the next unit in forward order itself
    (``forward_prefetch``, on by default). ``modules`` must be modules of units of this wrapper."""
    _check_units(self, modules, "set_modules_to_forward_prefetch")


def set_modules_to_backward_prefetch(self: FSDP, modules: Sequence[Any]) -> None:
    """FSDP2's explicit backward prefetch: accepted; pp.FSDP prefetches the next unit in backward order
    itself (``backward_prefetch``)."""
    _check_units(self, modules, "set_modules_to_backward_prefetch")


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns, as FSDP2's: ``wait()`` (the gathers are done already)."""

    def wait(self) -> None:
        return None


def unshard(self: FSDP, async_op: bool = False) -> UnshardHandle | None:
    """FSDP2's ``unshard``: every unit's parameters gathered in the module until ``reshard()`` (read them, or
    run no_grad forwards, as after FSDP2's). A forward starts as always (each unit gathered when used, resharded
    after it unless ``reshard_after_forward`` is False), so a forward after ``unshard()`` is what it would be
    without it. ``async_op=True`` returns a handle whose ``wait()`` returns at once."""
    self.finish_gradient_sync()
    gather = self._gather
    gather.discard_prefetches()
    for unit in self.units:
        gather.ensure_gathered(unit)
    return UnshardHandle() if _flag("async_op", async_op) else None


def reshard(self: FSDP) -> None:
    """FSDP2's ``reshard``: every gathered unit freed; its parameters are placeholders again."""
    for unit in self.units:
        if unit.gathered:
            self._gather.release(unit)


def _check_units(self: FSDP, modules: Sequence[Any], call: str) -> None:
    owned = {id(u.module) for u in self.units if u.module is not None} | {id(self.module)}
    strangers = [type(m).__name__ for m in modules if id(m) not in owned]
    if strangers:
        raise ValueError(f"FSDP.{call}: {', '.join(strangers)} are not modules of this FSDP's units")
