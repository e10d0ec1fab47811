"""How sharded state is described: the contract between sharding wrappers and checkpoints.

A wrapper that shards parameters (FSDP) describes every piece a rank holds as a
``ShardedArray``: a contiguous range of the flat (C-order) elements of a named global
array. A flat shard that concatenates pieces of several global arrays (an FSDP unit's
shard of its flat parameter) carries a ``FlatLayout``, which cuts any 1-D array aligned
with the shard (the parameter itself, its gradient, an optimizer moment) into per-array
``ShardedArray`` views. Checkpoints save and reshard from these descriptions alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

Array = Any


@dataclass(frozen=True)
class ShardedArray:
    """This rank's elements ``[start, start + local.size)`` of a flattened global array.

    ``local`` is 1-D. Owners return views into their live storage, so a loader that
    writes into ``local`` loads in place. Ranges of different ranks do not overlap; a
    rank may hold an empty range.
    """

    global_shape: tuple[int, ...]
    start: int
    local: Array

    def __post_init__(self) -> None:
        assert self.local.ndim == 1, "ShardedArray.local is 1-D"
        assert self.start >= 0 and self.stop <= self.numel, (self.start, self.stop, self.global_shape)

    @property
    def stop(self) -> int:
        return self.start + int(self.local.size)

    @property
    def numel(self) -> int:
        """Elements of the whole global array."""
        return math.prod(self.global_shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(self.local.dtype)


@dataclass(frozen=True)
class LayoutEntry:
    """One global array's piece inside a flat shard."""

    key: str
    """The global array's name (its ``state_dict`` key)."""
    global_shape: tuple[int, ...]
    start: int
    """First flat element of the global array that the shard holds."""
    offset: int
    """Where that element sits in the flat shard."""
    size: int
    """How many consecutive elements the shard holds."""


@dataclass(frozen=True)
class FlatLayout:
    """How a flat shard of ``numel`` elements maps onto named global arrays (padding excluded)."""

    entries: tuple[LayoutEntry, ...]
    numel: int

    def views(self, flat: Array) -> dict[str, ShardedArray]:
        """Per-array views of ``flat`` (any 1-D array aligned with the shard)."""
        if flat.ndim != 1 or int(flat.size) != self.numel:
            raise ValueError(f"expected a flat array of {self.numel} elements, got shape {tuple(flat.shape)}")
        return {
            e.key: ShardedArray(e.global_shape, e.start, flat[e.offset : e.offset + e.size])
            for e in self.entries
        }
