"""``all_to_all`` with split sizes (torch's ``all_to_all_single(out, x, output_split_sizes, input_split_sizes)``).

Rank ``i`` sends rows ``in_splits[j]`` of ``x`` (consecutive, in rank order) to rank ``j`` and receives
``out_splits[j]`` rows from each rank ``j``: a mixture-of-experts layer routes a different number of tokens to
each expert this way. Built on the plane's equal-block ``all_to_all``: the ranks exchange their row counts (one
small all_to_all), agree on the largest block (one small all_reduce, which also carries whether any rank's
``out_splits`` disagree with what is sent to it: a ``CollectiveMismatch`` on every rank, before any data moves),
then exchange blocks padded to that size. So a skewed routing moves ``n x`` the largest block, not the sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from paramplane.node.arrays import array_module
from paramplane.node.errors import CollectiveMismatch

if TYPE_CHECKING:
    from paramplane.group import ProcessGroup


def check_splits(splits: Sequence[int], n: int, rows: int | None, what: str) -> list[int]:
    """``splits`` as a list of ``n`` non-negative ints (summing to ``rows`` when given), else a ValueError."""
    values = [int(s) for s in splits]
    if len(values) != n or any(s < 0 or s != v for s, v in zip(values, splits, strict=True)):
        raise ValueError(
            f"all_to_all: {what} must be {n} non-negative integers (one per rank), got {list(splits)}"
        )
    if rows is not None and sum(values) != rows:
        raise ValueError(f"all_to_all: {what} {values} sum to {sum(values)}, not the {rows} rows of axis 0")
    return values


def uneven_all_to_all(
    group: ProcessGroup, x: Any, in_splits: Sequence[int] | None, out_splits: Sequence[int] | None, out: Any
) -> Any:
    """The exchange of the module docstring; ``out`` (or a new array when None) receives it and is returned.
    ``in_splits`` None: equal blocks of ``x``; ``out_splits`` None: as many rows as each rank sends."""
    n, me = group.size, group.rank
    if x.ndim == 0:
        raise ValueError("all_to_all needs an array with at least one axis (it splits axis 0)")
    rows, row_shape = int(x.shape[0]), tuple(int(d) for d in x.shape[1:])
    if in_splits is None:
        if rows % n:
            raise ValueError(
                f"all_to_all: without in_splits, the {rows} rows of axis 0 must divide by {n} ranks"
            )
        in_splits = [rows // n] * n
    sends = check_splits(in_splits, n, rows, "in_splits")
    expected = None
    if out_splits is not None:
        expected = check_splits(out_splits, n, None if out is None else int(out.shape[0]), "out_splits")
    if out is not None and (tuple(int(d) for d in out.shape[1:]) != row_shape or out.dtype != x.dtype):
        raise ValueError(
            f"all_to_all: out must hold rows of shape {row_shape} and dtype {x.dtype}, got {out.shape}"
        )
    got = group.all_to_all(np.array(sends, np.int64))  # got[j]: the rows rank j sends this rank
    receives = [int(v) for v in got]
    wrong = ""
    if expected is not None and expected != receives:
        wrong = f"rank {me} expects {expected} rows from ranks 0..{n - 1}, they send {receives}"
    elif out is not None and int(out.shape[0]) != sum(receives):
        wrong = f"rank {me}'s out holds {out.shape[0]} rows, ranks 0..{n - 1} send it {receives}"
    agreed = group.all_reduce(np.array([max(sends), int(bool(wrong))], np.int64), "max")
    if agreed[1]:  # every rank raises, before any data moves
        raise CollectiveMismatch(
            f"all_to_all split sizes disagree: {wrong}"
            if wrong
            else f"all_to_all split sizes disagree on another rank (rank {me} receives {receives} as it expects)"
        )
    if out is None:
        out = array_module(x).empty((sum(receives), *row_shape), x.dtype)
    block = int(agreed[0])
    if block == 0:
        return out
    xp = array_module(x)
    padded = xp.zeros((n * block, *row_shape), x.dtype)
    for j, start in enumerate(_starts(sends)):
        padded[j * block : j * block + sends[j]] = x[start : start + sends[j]]
    exchanged = group.all_to_all(padded)
    for j, start in enumerate(_starts(receives)):
        out[start : start + receives[j]] = exchanged[j * block : j * block + receives[j]]
    return out


def _starts(sizes: list[int]) -> list[int]:
    return [int(s) for s in np.cumsum([0, *sizes[:-1]])] if sizes else []


__all__ = ["check_splits", "uneven_all_to_all"]
