"""FSDP's gradient reduction: each unit's flat gradient reduce-scattered over the shard group as soon as
its backward is done (async, overlapping the rest of the backward), its shard then all-reduced over the
replicate group (compressed to ``comm_dtype`` when one is set), and every shard's ``grad`` set when the sync
finishes. Gradients are averaged over all N ranks.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.module import Array
from paramplane.node.arrays import array_module, is_floating, to_host, to_pinned
from paramplane.parallel.fsdp.config import MemoryTracker
from paramplane.parallel.fsdp.frozen import holds_frozen
from paramplane.parallel.fsdp.gather import Gatherer
from paramplane.parallel.fsdp.units import FlatUnit


class Reducer:
    """The gradient reductions of ``gather``'s units over ``group`` (module docstring).

    ``shard_group`` and ``replicate_group`` are replaced when the wrapper makes its groups again.
    """

    def __init__(
        self,
        group: ProcessGroup,
        shard_group: ProcessGroup,
        replicate_group: ProcessGroup,
        gather: Gatherer,
        memory: MemoryTracker,
        *,
        reduce_dtype: Any,
        master_dtype: Any,
        comm_dtype: Any,
        host_shards: bool,
    ) -> None:
        self.group = group
        self.gather = gather
        self.units = gather.units
        self.memory = memory
        self.xp: ModuleType = gather.xp
        self.reduce_dtype = reduce_dtype
        self.master_dtype = master_dtype
        self.comm_dtype = comm_dtype
        self.host_shards = host_shards
        # float16 mean: divide before the sum (which could overflow), as the engine's float16 mean does
        self.predivide = np.dtype(np.float16) in (reduce_dtype, comm_dtype)
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.no_sync = False
        """Inside ``FSDP.no_sync()``: backwards accumulate full gradients locally."""
        self.divide_factor: float | None = None
        """What the summed gradients are divided by (FSDP2's ``set_gradient_divide_factor``); None: the
        number of ranks (a mean)."""
        self.round_open = False
        """A synchronised backward ran since the last ``finish``."""
        self.queue: list[FlatUnit] = []
        """The units whose reduction was launched this round, in launch order."""

    def set_groups(self, shard_group: ProcessGroup, replicate_group: ProcessGroup) -> None:
        self.shard_group, self.replicate_group = shard_group, replicate_group

    def drop(self, unit: FlatUnit) -> None:
        """Forget the unit's reduction in flight (the step's work is dropped: ``FSDP.reform``)."""
        self.drop_flat(unit)
        unit.grad_work = unit.replicate_work = None
        unit.grad_shard = None
        for key in ("replicated", "wire"):
            unit.extra.pop(key, None)

    def reset(self) -> None:
        self.queue = []
        self.round_open = False

    def post_backward(self, unit: FlatUnit, *, release: bool = True) -> None:
        """The unit's gradients are done: reshard it (unless ``release`` is False: its frozen parameters may
        still be read) and (outside no_sync) launch its reduction."""
        self.gather.backward_done.add(id(unit))
        if release:
            self.gather.release(unit)
        if self.no_sync:
            return
        self.round_open = True
        flat = unit.flatten_grads(self.reduce_dtype, self.xp)
        if self.predivide:
            flat *= flat.dtype.type(1.0 / self._divisor())
        self.launch(unit, flat)

    def _divisor(self) -> float:
        return self.divide_factor if self.divide_factor is not None else float(self.group.size)

    def launch(self, unit: FlatUnit, flat: Array) -> None:
        if unit in self.queue:
            raise RuntimeError(
                f"FSDP: unit {unit.name!r} produced gradients twice in one step; call finish_gradient_sync() "
                "(or optimizer.step() on an attached optimizer) between synchronised backwards"
            )
        release = unit.extra["flat_release"] = self.memory.hold(
            "grads", flat.nbytes
        )  # with the layers' grads
        unit.drop_param_grads()
        if self.shard_group.size > 1:
            out = array_module(flat).empty(unit.shard_size, flat.dtype)
            unit.grad_shard = out
            # No reference to ``flat`` is kept: the group holds it while the reduce-scatter runs, so this
            # unit's largest transient is freed the moment the reduce-scatter is done (not when this thread
            # next looks), and reduce-scatters still in flight do not pile up flat gradients.
            unit.grad_work = self.shard_group.reduce_scatter(flat, "sum", out=out, async_op=True)
            unit.grad_work.future.add_done_callback(lambda _: release())
        else:
            unit.grad_shard = flat
        self.queue.append(unit)
        self.pump(block=False)

    @staticmethod
    def drop_flat(unit: FlatUnit) -> None:
        """The unit's flat gradient is gone (reduce-scattered, or the step's work dropped)."""
        unit.extra.pop("flat_release", lambda: None)()

    def pump(self, *, block: bool) -> None:
        """Start the replicate all-reduce of finished reduce-scatters, in unit launch order."""
        for unit in self.queue:
            if unit.extra.get("replicated"):
                continue
            if unit.grad_work is not None:
                if not block and not unit.grad_work.is_completed():
                    return
                unit.grad_work.wait()
                unit.grad_work = None
                self.drop_flat(unit)
            assert unit.grad_shard is not None
            if self.replicate_group.size > 1:
                wire = unit.grad_shard
                if self.comm_dtype is not None and is_floating(wire.dtype) and wire.dtype != self.comm_dtype:
                    wire = unit.extra["wire"] = wire.astype(self.comm_dtype)  # compressed across hosts
                unit.replicate_work = self.replicate_group.all_reduce(wire, "sum", async_op=True)
            unit.extra["replicated"] = True

    def finish(self) -> None:
        """``FSDP.finish_gradient_sync``: wait for every reduction and set each shard's averaged ``grad``."""
        self.gather.discard_prefetches()
        if not self.round_open:
            return
        try:
            for unit in self.units:  # units whose backward never ran (unused): zeros, same on every rank
                if unit.extra.get("num_trainable") == 0:  # frozen parameters only: nothing to reduce
                    continue
                if unit not in self.queue and unit.has_param_grads():
                    self.post_backward(unit)  # torch: some of its parameters got no gradient this backward
                elif unit not in self.queue:
                    self.launch(unit, self.xp.zeros(unit.padded, self.reduce_dtype))
            self.pump(block=True)
            for unit in self.units:  # the backward is over: units holding frozen parameters reshard now too
                if holds_frozen(unit):
                    self.gather.release(unit)
                    unit.extra["pending_inputs"] = 0  # a forward whose backward never ran waits no more
            scale = 1.0 if self.predivide else 1.0 / self._divisor()
            for unit in self.queue:
                if unit.replicate_work is not None:
                    unit.replicate_work.wait()
                assert unit.grad_shard is not None
                if "wire" in unit.extra:
                    unit.grad_shard[...] = unit.extra.pop("wire")
                g = unit.grad_shard.astype(self.master_dtype) * scale
                shard = unit.shard
                if self.host_shards and shard.grad is None:  # into this unit's reused page-locked buffer
                    shard.grad = unit.extra["pinned_grad"] = to_pinned(g, unit.extra.get("pinned_grad"))
                elif self.host_shards:
                    shard.grad += to_host(g)
                elif shard.grad is None:
                    shard.grad = g
                else:
                    shard.grad += g
        finally:
            for unit in self.queue:
                self.drop_flat(unit)
                unit.grad_shard = None
                unit.grad_work = unit.replicate_work = None
                unit.extra.pop("replicated", None)
                unit.extra.pop("wire", None)
            self.reset()
