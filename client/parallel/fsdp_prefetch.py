"""FSDP's all-gathers: gathering a unit for its use, prefetching the next one, dropping stale prefetches.

A gather reads the shard when it runs (on the group's thread, while this thread computes) and holds the
values of that moment, so a prefetched gather must never outlive a change of the shards: every pending
gather is waited for and dropped at the start of a forward and wherever the shards can change (the
gradient sync that runs before an attached optimizer's step, loading state, ``summon_full_params``).

Prefetching follows the order the units are really used, not the order they were registered in: a
unit's forward prefetches the unit the previous forward used after it (registration order until one
forward ran), and a unit's backward prefetches the unit used before it in this step's forward, unless
that unit's backward already ran this step (it would be gathered for nothing, and left over).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from paramplane.nn.module import Array
from paramplane.node.arrays import is_floating
from paramplane.parallel.fsdp_config import MemoryTracker
from paramplane.parallel.fsdp_state import FSDPState
from paramplane.parallel.fsdp_units import FlatUnit


class FSDPPrefetch(FSDPState):
    """Gathering and prefetching for ``FSDP`` (a mixin; the attributes are set in ``FSDP.__init__``)."""

    units: list[FlatUnit]
    _wrapped: list[FlatUnit]
    _root: FlatUnit | None
    _xp: ModuleType
    param_dtype: Any
    forward_prefetch: bool
    memory: MemoryTracker

    def _init_order(self) -> None:
        self._forward_order: list[FlatUnit] = list(self._wrapped)
        """The wrapped units in the order the last forward first used them (registration order at first)."""
        self._used: list[FlatUnit] = []
        """This step's forward order: each wrapped unit at its first use."""
        self._backward_done: set[int] = set()
        """ids of the units whose backward ran since this step's forward began."""

    def _begin_forward(self) -> None:
        """Start a forward: drop pending gathers and gathered units (the shards may have changed since),
        note the last forward's unit order, gather the root unit and prefetch the first unit."""
        self._discard_prefetches()
        if self._used:
            self._forward_order = self._used
        self._used = []
        self._backward_done = set()
        for u in self.units:
            if u.gathered and u is not self._root:
                self._release(u)  # a previous forward without backward (eval), or a prefetch that went unused
        if self._root is not None:
            self._release(self._root)
            self._ensure_gathered(self._root)
        if self.forward_prefetch and self._forward_order:
            self._prefetch(self._forward_order[0])

    def _enter_unit(self, unit: FlatUnit) -> None:
        """Before a unit's forward: note its use, gather it and prefetch the one expected next."""
        if all(u is not unit for u in self._used):
            self._used.append(unit)
        self._ensure_gathered(unit)
        if self.forward_prefetch:
            self._prefetch(self._next_in_forward(unit))

    def _next_in_forward(self, unit: FlatUnit) -> FlatUnit | None:
        order = self._forward_order
        at = next((i for i, u in enumerate(order) if u is unit), None)
        if at is None:  # not used by the last forward: its registration neighbour
            order = self._wrapped
            at = next(i for i, u in enumerate(order) if u is unit)
        nxt = order[at + 1] if at + 1 < len(order) else None
        if nxt is None or any(u is nxt for u in self._used):
            return None  # already used in this forward: it is gathered again when it is called again
        return nxt

    def _prev_in_forward(self, unit: FlatUnit) -> FlatUnit | None:
        """The unit to prefetch around ``unit``'s backward: used just before it in this step's forward,
        if its own backward has not run yet."""
        at = next((i for i, u in enumerate(self._used) if u is unit), None)
        if not at:  # first used (or not used at all) in this forward
            return None
        prev = self._used[at - 1]
        return None if id(prev) in self._backward_done else prev

    def _discard_prefetches(self) -> None:
        """Wait for every pending all-gather and drop it: it may hold values the shards no longer have, and
        it reads the shard on the group's thread (an optimizer must not write the shard meanwhile)."""
        for unit in self.units:
            work, unit.gather_work = unit.gather_work, None
            if work is not None:
                work.wait()

    def _prefetch(self, unit: FlatUnit | None, dtype: Any = None) -> None:
        """Start ``unit``'s all-gather unless it is gathered or on its way."""
        if unit is None or unit.gathered or unit.gather_work is not None:
            return
        dtype = np.dtype(dtype) if dtype is not None else self.param_dtype
        src = self._xp.asarray(unit.shard.data)  # an offloaded shard travels to the device here
        src = src if src.dtype == dtype else src.astype(dtype)
        if self.shard_group.size == 1:
            self._use(unit, src)
            return
        # The group holds ``src`` while the gather runs and allocates the gathered buffer when it runs, not
        # now: a prefetch queued behind a reduce-scatter holds no memory until that one is done and freed.
        unit.gather_work = self.shard_group.all_gather(src, async_op=True)

    def _ensure_gathered(self, unit: FlatUnit, dtype: Any = None) -> None:
        if unit.gathered:
            return
        self._prefetch(unit, dtype)
        if unit.gather_work is not None:
            full = unit.gather_work.wait()
            unit.gather_work = None
            self._use(unit, full)

    def _use(self, unit: FlatUnit, full: Array) -> None:
        unit.use_full(full)
        if full is not unit.shard.data:
            self.memory.add("params_gathered", full.nbytes)

    def _release(self, unit: FlatUnit) -> None:
        if unit.full is not None and unit.full is not unit.shard.data:
            self.memory.add("params_gathered", -unit.full.nbytes)
        unit.release()

    def _cast_input(self, x: Any) -> Any:
        """A floating-point input in ``param_dtype`` when mixed precision computes in another dtype."""
        if self.param_dtype == self.master_dtype or not hasattr(x, "dtype") or not is_floating(x.dtype):
            return x
        return x if x.dtype == self.param_dtype else x.astype(self.param_dtype)
