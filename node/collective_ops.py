"""Each collective run on one comm: device arrays staged through host memory for host comms, ``mean``
applied once after (or, for float16, before) the transport's sum. The engine calls these in issue order
with the comm it chose; nothing here waits for a turn or records failures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from paramplane.node.arrays import array_module, is_cupy, is_device, to_host
from paramplane.node.spec import OpSpec
from paramplane.node.transports.base import Bounds, Comm, Splits


class _Staged:
    """``x`` as the comm takes it: itself (host comm and numpy, or a device comm) or a host copy."""

    def __init__(self, x: Any, comm: Comm, *, copy_in: bool = True) -> None:
        self.x = x
        self.staged = is_device(x) and not comm.device
        if self.staged:
            self.arr = to_host(x) if copy_in else np.empty(x.shape, x.dtype)
        else:
            self.arr = x
        self.flat = self.arr.reshape(-1)

    def write_back(self) -> None:
        if self.staged:
            self.x[...] = array_module(self.x).asarray(self.arr)


def _mean(x: Any, n: int) -> None:
    if n > 1:
        if is_cupy(x):
            x /= n
        else:
            np.true_divide(x, n, out=x, casting="unsafe")


def _divides_first(x: Any, op: str, n: int) -> bool:
    """A float16 ``mean`` divides each rank's values before the sum (as NCCL's ``ncclAvg`` does): a sum of
    float16 values overflows past 65504 where their mean need not (gradients averaged over ranks). Wider
    types sum first, which keeps their smallest values exact."""
    return op == "mean" and n > 1 and x.dtype == np.float16


def all_reduce(comm: Comm, spec: OpSpec, deadline: float, n: int, x: Any, op: str) -> Any:
    """Reduce ``x`` in place; returns it."""
    s = _Staged(x, comm)
    first = _divides_first(x, op, n)
    if first:
        _mean(s.flat, n)  # in place: the op overwrites x anyway
    comm.all_reduce(spec, s.flat, "sum" if op == "mean" else op, deadline)
    s.write_back()
    if op == "mean" and not first:
        _mean(x, n)
    return x


def broadcast(comm: Comm, spec: OpSpec, deadline: float, x: Any, root: int, is_root: bool) -> Any:
    """Overwrite ``x`` with ``root``'s; returns it."""
    s = _Staged(x, comm, copy_in=is_root)
    comm.broadcast(spec, s.flat, root, deadline)
    s.write_back()
    return x


def all_gather(comm: Comm, spec: OpSpec, deadline: float, x: Any, out: Any, shape: tuple[int, ...]) -> Any:
    """Into ``out``, or (None) a new array of ``shape``, which is returned."""
    if out is None:
        out = array_module(x).empty(shape, x.dtype)
    piece, result = _Staged(x, comm), _Staged(out, comm, copy_in=False)
    comm.all_gather(spec, piece.flat, result.flat, deadline)
    result.write_back()
    return out


def reduce_scatter(
    comm: Comm,
    spec: OpSpec,
    deadline: float,
    n: int,
    x: Any,
    bounds: Bounds,
    op: str,
    out: Any,
    shape: tuple[int, ...],
) -> Any:
    """Into ``out``, or (None) a new array of ``shape``, which is returned."""
    if out is None:
        out = array_module(x).empty(shape, x.dtype)
    flat, result = _Staged(x, comm), _Staged(out, comm, copy_in=False)
    first = _divides_first(x, op, n)
    source = flat.flat
    if first:
        source = source / n  # a copy: the caller's input stays as it was
    comm.reduce_scatter(spec, source, bounds, "sum" if op == "mean" else op, result.flat, deadline)
    result.write_back()
    if op == "mean" and not first:
        _mean(out, n)
    return out


def gather(
    comm: Comm, spec: OpSpec, deadline: float, x: Any, root: int, shape: tuple[int, ...] | None
) -> Any | None:
    """On ``root`` (``shape`` given there): a new array of ``shape`` holding every rank's ``x``; else None."""
    out = array_module(x).empty(shape, x.dtype) if shape is not None else None
    piece = _Staged(x, comm)
    result = _Staged(out, comm, copy_in=False) if out is not None else None
    comm.gather(spec, piece.flat, root, result.flat if result is not None else None, deadline)
    if result is not None:
        result.write_back()
    return out


def scatter(
    comm: Comm, spec: OpSpec, deadline: float, pieces: Sequence[Any] | None, root: int, out: Any
) -> Any:
    flats = [_Staged(p, comm).flat for p in pieces] if pieces is not None else None
    result = _Staged(out, comm, copy_in=False)
    comm.scatter(spec, flats, root, result.flat, deadline)
    result.write_back()
    return out


def all_to_all(comm: Comm, spec: OpSpec, deadline: float, x: Any, out: Any) -> Any:
    """Into ``out``, or (None) a new array like ``x``, which is returned."""
    if out is None:
        out = array_module(x).empty_like(x)
    flat, result = _Staged(x, comm), _Staged(out, comm, copy_in=False)
    comm.all_to_all(spec, flat.flat, result.flat, deadline)
    result.write_back()
    return out


def all_to_allv(comm: Comm, spec: OpSpec, deadline: float, x: Any, out: Any, splits: Splits) -> Any:
    """Into ``out``: ``Comm.all_to_allv`` of ``x`` (its pieces of ``splits``' element counts, in order)."""
    flat, result = _Staged(x, comm), _Staged(out, comm, copy_in=False)
    comm.all_to_allv(spec, flat.flat, result.flat, splits, deadline)
    result.write_back()
    return out


def barrier(comm: Comm, spec: OpSpec, deadline: float) -> None:
    comm.barrier(spec, deadline)
