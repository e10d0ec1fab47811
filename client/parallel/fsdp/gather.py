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

from paramplane.group import ProcessGroup
from paramplane.nn.module import Array
from paramplane.parallel.fsdp.config import MemoryTracker
from paramplane.parallel.fsdp.units import FlatUnit


class Gatherer:
    """The all-gathers of ``units`` over ``shard_group`` and the prefetch order (module docstring).

    ``shard_group`` is replaced when the wrapper makes its groups again (``FSDP.reform``).
    """

    def __init__(
        self,
        units: list[FlatUnit],
        shard_group: ProcessGroup,
        xp: ModuleType,
        param_dtype: Any,
        memory: MemoryTracker,
        *,
        forward_prefetch: bool,
    ) -> None:
        self.units = units
        self.wrapped = [u for u in units if u.module is not None]
        """The units with a module (their module's forward brackets their use)."""
        self.root = next((u for u in units if u.module is None), None)
        """The root unit (the parameters no unit module owns), gathered for the whole forward and backward."""
        self.shard_group = shard_group
        self.xp = xp
        self.param_dtype = param_dtype
        self.memory = memory
        self.forward_prefetch = forward_prefetch
        self.forward_order: list[FlatUnit] = list(self.wrapped)
        """The wrapped units in the order the last forward first used them (registration order at first)."""
        self.used: list[FlatUnit] = []
        """This step's forward order: each wrapped unit at its first use."""
        self.backward_done: set[int] = set()
        """ids of the units whose backward ran since this step's forward began."""

    def reset(self, shard_group: ProcessGroup) -> None:
        """After the groups were made again: forget this step's order (the last forward's is kept)."""
        self.shard_group = shard_group
        self.used, self.backward_done = [], set()

    def begin_forward(self) -> None:
        """Start a forward: drop pending gathers and gathered units (the shards may have changed since),
        note the last forward's unit order, gather the root unit and prefetch the first unit."""
        self.discard_prefetches()
        if self.used:
            self.forward_order = self.used
        self.used = []
        self.backward_done = set()
        for u in self.units:
            if u.gathered and u is not self.root:
                self.release(u)  # a previous forward without backward (eval), or a prefetch that went unused
        if self.root is not None:
            self.release(self.root)
            self.ensure_gathered(self.root)
        if self.forward_prefetch and self.forward_order:
            self.prefetch(self.forward_order[0])

    def enter_unit(self, unit: FlatUnit) -> None:
        """Before a unit's forward: note its use, gather it and prefetch the one expected next."""
        if all(u is not unit for u in self.used):
            self.used.append(unit)
        self.ensure_gathered(unit)
        if self.forward_prefetch:
            self.prefetch(self.next_in_forward(unit))

    def next_in_forward(self, unit: FlatUnit) -> FlatUnit | None:
        order = self.forward_order
        at = next((i for i, u in enumerate(order) if u is unit), None)
        if at is None:  # not used by the last forward: its registration neighbour
            order = self.wrapped
            at = next(i for i, u in enumerate(order) if u is unit)
        nxt = order[at + 1] if at + 1 < len(order) else None
        if nxt is None or any(u is nxt for u in self.used):
            return None  # already used in this forward: it is gathered again when it is called again
        return nxt

    def prev_in_forward(self, unit: FlatUnit) -> FlatUnit | None:
        """The unit to prefetch around ``unit``'s backward: used just before it in this step's forward,
        if its own backward has not run yet."""
        at = next((i for i, u in enumerate(self.used) if u is unit), None)
        if not at:  # first used (or not used at all) in this forward
            return None
        prev = self.used[at - 1]
        return None if id(prev) in self.backward_done else prev

    def discard_prefetches(self) -> None:
        """Wait for every pending all-gather and drop it: it may hold values the shards no longer have, and
        it reads the shard on the group's thread (an optimizer must not write the shard meanwhile)."""
        for unit in self.units:
            work, unit.gather_work = unit.gather_work, None
            if work is not None:
                work.wait()

    def prefetch(self, unit: FlatUnit | None, dtype: Any = None) -> None:
        """Start ``unit``'s all-gather unless it is gathered or on its way."""
        if unit is None or unit.gathered or unit.gather_work is not None:
            return
        dtype = np.dtype(dtype) if dtype is not None else self.param_dtype
        src = self.xp.asarray(unit.shard.data)  # an offloaded shard travels to the device here
        src = src if src.dtype == dtype else src.astype(dtype)
        if self.shard_group.size == 1:
            self.use(unit, src)
            return
        # The group holds ``src`` while the gather runs and allocates the gathered buffer when it runs, not
        # now: a prefetch queued behind a reduce-scatter holds no memory until that one is done and freed.
        unit.gather_work = self.shard_group.all_gather(src, async_op=True)

    def ensure_gathered(self, unit: FlatUnit, dtype: Any = None) -> None:
        if unit.gathered:
            return
        self.prefetch(unit, dtype)
        if unit.gather_work is not None:
            full = unit.gather_work.wait()
            unit.gather_work = None
            self.use(unit, full)

    def use(self, unit: FlatUnit, full: Array) -> None:
        unit.use_full(full)
        if full is not unit.shard.data:
            self.memory.add("params_gathered", full.nbytes)

    def release(self, unit: FlatUnit) -> None:
        if unit.full is not None and unit.full is not unit.shard.data:
            self.memory.add("params_gathered", -unit.full.nbytes)
        unit.release()
