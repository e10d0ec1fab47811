"""What every rank of a collective must agree on, and the reduction and split rules all transports share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

REDUCE_OPS = ("sum", "mean", "min", "max", "product")
_UFUNCS = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum, "product": np.multiply}


def check_reduce_op(op: str, dtype: np.dtype[Any]) -> None:
    """ValueError for an unknown reduction or one that makes no sense for ``dtype``."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}; use one of {', '.join(REDUCE_OPS)}")
    if op == "mean" and dtype.kind not in "fV":
        raise ValueError(
            f"op='mean' needs a floating dtype, got {dtype}; reduce with 'sum' and divide yourself"
        )


def reduce_ufunc(op: str) -> Any:
    """The numpy (or cupy: same name) ufunc that combines two contributions of ``op``."""
    return _UFUNCS[op]


def split_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each of ``parts`` pieces of ``total`` items, like ``numpy.array_split``.

    The first ``total % parts`` pieces hold one item more than the others. reduce_scatter
    splits rows along axis 0 with this rule.
    """
    base, extra = divmod(total, parts)
    bounds = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


@dataclass(frozen=True)
class OpSpec:
    """One collective as issued by one rank: the fields every rank must agree on."""

    group: str
    seq: int
    op: str
    dtype: str
    shape: tuple[int, ...]
    arg: str = ""

    def describe(self) -> str:
        extra = f", {self.arg}" if self.arg else ""
        return f"{self.op}({self.dtype}, shape {self.shape}{extra})"

    def mismatch(self, me: int, other: int, theirs: OpSpec) -> str | None:
        """The error text when ``theirs`` (from rank ``other``) disagrees with this spec (rank ``me``)."""
        if (self.seq, self.op, self.dtype, self.shape, self.arg) == (
            theirs.seq,
            theirs.op,
            theirs.dtype,
            theirs.shape,
            theirs.arg,
        ):
            return None
        return (
            f"collective mismatch in group '{self.group}' at op #{self.seq}: rank {me} issued "
            f"{self.describe()} but rank {other} issued {theirs.describe()}"
            + (f" (its op #{theirs.seq})" if theirs.seq != self.seq else "")
            + "; every rank of a group must issue the same collectives in the same order with the same "
            "dtype and shape"
        )
