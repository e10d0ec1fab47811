"""Megatron's conjugate mappings (``tensor_parallel/mappings.py``) as torch autograd Functions.

``copy_to`` (f): identity forward, all-reduce of the gradient backward. ``reduce_from`` (g): all-reduce
forward, identity backward. ``gather_last``: all-gather along the last dimension forward, this rank's slice
of the gradient backward. ``scatter_last``: the slice forward, all-gather backward. Every collective is the
group's own, on a zero-copy DLPack view of the tensor's data (``torch_params.to_array``; CUDA tensors on
torch's current stream).

A column layer's input is usually shared by several column layers (Llama's q, k and v projections, its gate
and up projections): ``SharedCopy`` passes one tensor through f once and hands the same result to each, so
the input gradient is all-reduced once per column/row pair, as Megatron's fused QKV does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.parallel.torch_params import to_array, to_tensor, torch_stream

__all__ = [
    "SharedCopy",
    "all_reduce_",
    "copy_to",
    "gather_last",
    "gather_seq",
    "leave_seq",
    "reduce_from",
    "reduce_scatter_seq",
    "scatter_last",
    "split_seq",
]


def all_reduce_(t: Any, group: ProcessGroup, op: str = "sum") -> Any:
    """Reduce the contiguous tensor ``t`` (no autograd history) over ``group`` in place; returns ``t``."""
    if group.size > 1:
        with torch_stream(t):
            group.all_reduce(to_array(t, "a tensor-parallel activation"), op)
    return t


def _fresh(t: Any) -> Any:
    """A contiguous copy of ``t`` the caller may change in place."""
    import torch

    return t.detach().clone(memory_format=torch.contiguous_format)


def _gather(t: Any, group: ProcessGroup) -> Any:
    """Every rank's ``t`` concatenated along the last dimension, in group order."""
    if group.size == 1:
        return t
    front = t.detach().movedim(-1, 0).contiguous()
    with torch_stream(front):
        gathered = to_tensor(group.all_gather(to_array(front, "a tensor-parallel activation")))
    return gathered.movedim(0, -1).contiguous()


def _split(t: Any, group: ProcessGroup) -> Any:
    size = t.shape[-1]
    if size % group.size:
        raise ValueError(
            f"last dimension of size {size} does not split evenly over {group.size} tensor-parallel ranks"
        )
    k = size // group.size
    return t[..., group.rank * k : (group.rank + 1) * k].contiguous()


def _gather_seq(t: Any, group: ProcessGroup) -> Any:
    """Every rank's ``t`` concatenated along dimension 1 (the sequence), in group order."""
    front = t.detach().movedim(1, 0).contiguous()
    with torch_stream(front):
        gathered = to_tensor(group.all_gather(to_array(front, "a sequence-parallel activation")))
    return gathered.movedim(0, 1).contiguous()


def _reduce_scatter_seq(t: Any, group: ProcessGroup) -> Any:
    """This rank's equal part, along dimension 1, of the sum of ``t`` over the group."""
    _check_seq(t, group)
    front = t.detach().movedim(1, 0).contiguous()
    with torch_stream(front):
        part = to_tensor(group.reduce_scatter(to_array(front, "a sequence-parallel activation"), "sum"))
    return part.movedim(0, 1).contiguous()


def _check_seq(t: Any, group: ProcessGroup) -> int:
    if t.dim() < 2 or t.shape[1] % group.size:
        raise ValueError(
            f"sequence parallel splits dimension 1 (the sequence) over {group.size} ranks; got shape "
            f"{tuple(t.shape)}: the sequence length must be divisible by the tensor-parallel size"
        )
    return int(t.shape[1]) // group.size


def _split_seq(t: Any, group: ProcessGroup) -> Any:
    k = _check_seq(t, group)
    return t.detach()[:, group.rank * k : (group.rank + 1) * k].contiguous()


def _function() -> Any:
    import torch

    return torch.autograd.Function


class _Fns:
    """The autograd Functions, built on first use (torch is imported only when a torch module is parallelised)."""

    built: dict[str, Any] = {}

    @classmethod
    def get(cls, name: str) -> Any:
        if not cls.built:
            cls._build()
        return cls.built[name]

    @classmethod
    def _build(cls) -> None:
        Function = _function()

        class CopyTo(Function):  # type: ignore[misc, valid-type]
            @staticmethod
            def forward(ctx: Any, x: Any, group: ProcessGroup) -> Any:
                ctx.group = group
                return x.view_as(x)

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                return all_reduce_(_fresh(grad), ctx.group), None

        class ReduceFrom(Function):  # type: ignore[misc, valid-type]
            @staticmethod
            def forward(ctx: Any, x: Any, group: ProcessGroup) -> Any:
                return all_reduce_(_fresh(x), group)

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                return grad, None

        def conjugate(
            forward_op: Callable[[Any, ProcessGroup], Any], backward_op: Callable[[Any, ProcessGroup], Any]
        ) -> Any:
            """A Function whose forward applies ``forward_op`` over the group and backward ``backward_op``."""

            class Conjugate(Function):  # type: ignore[misc, valid-type]
                @staticmethod
                def forward(ctx: Any, x: Any, group: ProcessGroup) -> Any:
                    ctx.group = group
                    return forward_op(x, group)

                @staticmethod
                def backward(ctx: Any, grad: Any) -> Any:
                    return backward_op(grad, ctx.group), None

            return Conjugate

        cls.built.update(
            copy=CopyTo,
            reduce=ReduceFrom,
            gather=conjugate(_gather, _split),
            scatter=conjugate(lambda x, g: _split(x.detach(), g), _gather),
            gather_seq=conjugate(_gather_seq, _reduce_scatter_seq),
            reduce_scatter_seq=conjugate(_reduce_scatter_seq, _gather_seq),
            split_seq=conjugate(_split_seq, _gather_seq),
            leave_seq=conjugate(_gather_seq, _split_seq),
        )


def copy_to(x: Any, group: ProcessGroup) -> Any:
    """f: ``x`` unchanged; its gradient all-reduced over ``group``."""
    return _Fns.get("copy").apply(x, group) if group.size > 1 else x


def reduce_from(x: Any, group: ProcessGroup) -> Any:
    """g: the sum of ``x`` over ``group``; the gradient passes through."""
    return _Fns.get("reduce").apply(x, group) if group.size > 1 else x


def gather_last(x: Any, group: ProcessGroup) -> Any:
    """Every rank's ``x`` concatenated along the last dimension; backward keeps this rank's slice."""
    return _Fns.get("gather").apply(x, group) if group.size > 1 else x


def scatter_last(x: Any, group: ProcessGroup) -> Any:
    """This rank's equal slice of ``x`` along the last dimension; backward all-gathers the gradient."""
    return _Fns.get("scatter").apply(x, group) if group.size > 1 else x


def gather_seq(x: Any, group: ProcessGroup) -> Any:
    """Sequence parallel's entry to a column layer: all-gather along dimension 1; backward reduce-scatters."""
    return _Fns.get("gather_seq").apply(x, group) if group.size > 1 else x


def reduce_scatter_seq(x: Any, group: ProcessGroup) -> Any:
    """Sequence parallel's exit from a row layer: the sum over the group, this rank's part of dimension 1;
    backward all-gathers."""
    return _Fns.get("reduce_scatter_seq").apply(x, group) if group.size > 1 else x


def split_seq(x: Any, group: ProcessGroup) -> Any:
    """The start of a sequence-parallel region: this rank's part of dimension 1; backward all-gathers."""
    return _Fns.get("split_seq").apply(x, group) if group.size > 1 else x


def leave_seq(x: Any, group: ProcessGroup) -> Any:
    """The end of a sequence-parallel region: all-gather along dimension 1 into a replicated tensor; backward
    keeps this rank's part of the (replicated) gradient."""
    return _Fns.get("leave_seq").apply(x, group) if group.size > 1 else x


class SharedCopy:
    """f (or, for a sequence-parallel input, the all-gather along the sequence) applied once per input
    tensor: consecutive column layers reading the same tensor (same object, same version) share it, so their
    input gradients are summed locally and reduced once."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self._last: tuple[Any, int, bool, Any] | None = None

    def __call__(self, x: Any, sequence: bool = False) -> Any:
        if self.group.size == 1 or (not x.requires_grad and not sequence):
            return x
        last = self._last
        if last is not None and last[0]() is x and last[1] == x._version and last[2] == sequence:
            return last[3]
        y = gather_seq(x, self.group) if sequence else copy_to(x, self.group)
        self._last = (weakref.ref(x), x._version, sequence, y)
        return y

    def clear(self) -> None:
        self._last = None
