"""``all_to_all`` with split sizes (torch's ``all_to_all_single(out, x, output_split_sizes, input_split_sizes)``).

Rank ``i`` sends rows ``in_splits[j]`` of ``x`` (consecutive, in rank order) to rank ``j`` and receives
``out_splits[j]`` rows from each rank ``j``: a mixture-of-experts layer routes a different number of tokens to
each expert this way. The ranks first gather every rank's row counts (one small all_gather of each rank's
sends, its expected receives and its ``out``'s rows), so every rank finds the same disagreement, if any: a
``CollectiveMismatch`` on every rank, before any data moves. Then the engine's ``all_to_allv`` moves each
rank's rows as they are (no padding): over shared memory each rank's input streams through its slot and each
rank reads its pieces where they lie, over lanes and gRPC one frame per piece.
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
    if out is not None and array_module(x).may_share_memory(out, x):
        raise ValueError("all_to_all: out must not overlap the input")
    # One small all_gather gives every rank the whole table: what each rank sends each, what it expects from
    # each (-1: not given) and its out's rows (-1: none), so every rank finds the same disagreement.
    mine = np.full(2 * n + 1, -1, np.int64)
    mine[:n] = sends
    if expected is not None:
        mine[n : 2 * n] = expected
    if out is not None:
        mine[2 * n] = int(out.shape[0])
    table = group.all_gather(mine).reshape(n, 2 * n + 1)
    wrong = _disagreement(table, n)
    if wrong:  # every rank raises, before any data moves
        raise CollectiveMismatch(f"all_to_all split sizes disagree: {wrong}")
    receives = [int(v) for v in table[:, me]]
    if out is None:
        out = array_module(x).empty((sum(receives), *row_shape), x.dtype)
    if not table[:, :n].any():
        return out
    xp = array_module(x)
    into = out if out.flags.c_contiguous else xp.empty(out.shape, out.dtype)
    group._e.all_to_allv(xp.ascontiguousarray(x), into, table[:, :n].tolist()).result()
    if into is not out:
        out[...] = into
    return out


def _disagreement(table: np.ndarray, n: int) -> str:
    """The first rank whose expected rows or out differ from what the others send it (``""``: none)."""
    for rank in range(n):
        receives = [int(v) for v in table[:, rank]]
        expected, rows = [int(v) for v in table[rank, n : 2 * n]], int(table[rank, 2 * n])
        if expected[0] >= 0 and expected != receives:
            return f"rank {rank} expects {expected} rows from ranks 0..{n - 1}, they send {receives}"
        if rows >= 0 and rows != sum(receives):
            return f"rank {rank}'s out holds {rows} rows, ranks 0..{n - 1} send it {receives}"
    return ""


__all__ = ["check_splits", "uneven_all_to_all"]
