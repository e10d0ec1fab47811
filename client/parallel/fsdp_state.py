"""FSDP's state: full and sharded state dicts, loading them, and ``summon_full_params`` (a mixin of ``FSDP``).

Frozen parameters (``requires_grad=False``) are not sharded: like buffers they are replicated module state,
kept whole on every rank (broadcast from group rank 0 at wrap time with ``sync_module_states``), in the state
dicts under their names and, in ``sharded_state_dict``, as whole arrays (a checkpoint writes them once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.nn.module import Array, Module
from paramplane.node.arrays import array_module, on_module
from paramplane.parallel.fsdp_units import FlatUnit
from paramplane.parallel.sharding import ShardedArray


class FSDPState:
    """What ``FSDP`` provides the state methods (set in ``FSDP.__init__``)."""

    module: Module
    units: list[FlatUnit]
    shard_group: ProcessGroup
    master_dtype: Any
    _xp: ModuleType

    def finish_gradient_sync(self) -> None:
        raise NotImplementedError

    def _use(self, unit: FlatUnit, full: Array) -> None:
        raise NotImplementedError

    def _release(self, unit: FlatUnit) -> None:
        raise NotImplementedError

    def _discard_prefetches(self) -> None:
        raise NotImplementedError

    def _buffers(self) -> list[tuple[str, Array]]:
        return list(self.module.named_buffers())

    def _frozen(self) -> list[tuple[str, Array]]:
        """The frozen parameters' arrays (not sharded: replicated like buffers)."""
        return [(n, p.data) for n, p in self.module.named_parameters() if not p.requires_grad]

    def _replicated(self) -> dict[str, Array]:
        """Frozen parameters and buffers by name: the module state every rank holds whole."""
        return {**dict(self._frozen()), **dict(self._buffers())}

    def _gather_master(self, unit: FlatUnit) -> Array:
        """The unit's full flat parameter in the master dtype (a collective on the shard group)."""
        if self.shard_group.size == 1:
            return unit.shard.data.copy()
        out = array_module(unit.shard.data).empty(unit.padded, self.master_dtype)
        self.shard_group.all_gather(unit.shard.data, out=out)
        return out

    def state_dict(self) -> dict[str, Array]:
        """The full, unsharded state (same keys as ``module.state_dict()``), on every rank."""
        values: dict[str, Array] = {}
        for unit in self.units:
            full = self._gather_master(unit)
            for name, p, off in zip(unit.names, unit.params, unit.offsets):
                values[name] = full[off : off + p.size].reshape(p.shape).copy()
        frozen = dict(self._frozen())
        out = {}
        for name, _ in self.module.named_parameters():
            if name in values:
                out[name] = values[name]
            elif name in frozen:
                out[name] = frozen[name].copy()
        for name, buf in self._buffers():
            out[name] = buf.copy()
        return out

    def load_state_dict(self, state: dict[str, Array]) -> None:
        """Load a full state dict: every rank keeps its shard (no communication)."""
        self._discard_prefetches()
        wanted = {n: p.shape for u in self.units for n, p in zip(u.names, u.params)}
        buffers = self._replicated()
        missing = sorted((set(wanted) | set(buffers)) - set(state))
        unexpected = sorted(set(state) - set(wanted) - set(buffers))
        if missing or unexpected:
            raise ValueError(f"FSDP.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for key, shape in [*wanted.items(), *((k, tuple(b.shape)) for k, b in buffers.items())]:
            if tuple(state[key].shape) != tuple(shape):
                raise ValueError(
                    f"FSDP.load_state_dict: {key!r} has shape {tuple(state[key].shape)}, expected {shape}"
                )
        for unit in self.units:
            self._release(unit)
            xp = array_module(unit.shard.data)
            flat = xp.zeros(unit.padded, self.master_dtype)
            for name, p, off in zip(unit.names, unit.params, unit.offsets):
                flat[off : off + p.size] = on_module(xp, state[name]).reshape(-1)
            self._keep_shard(unit, flat)
        for key, buf in buffers.items():
            buf[...] = on_module(array_module(buf), state[key])

    def _keep_shard(self, unit: FlatUnit, flat: Array) -> None:
        """Copy this rank's piece of the full flat parameter ``flat`` into its shard (wherever that lives)."""
        lo = self.shard_group.rank * unit.shard_size
        unit.shard.data[...] = on_module(array_module(unit.shard.data), flat[lo : lo + unit.shard_size])

    def sharded_state_dict(self) -> dict[str, ShardedArray | Array]:
        """This rank's pieces as ``ShardedArray`` views into the live shards, plus frozen parameters and
        buffers (replicated, whole arrays).

        Replicas (no_shard, hybrid) hold equal ranges; a writer keeps one of them.
        """
        sliced = [
            n for unit in self.units for n, p in zip(unit.names, unit.params) if getattr(p, "shard", None)
        ]
        if sliced:
            raise ValueError(
                f"FSDP over tensor-parallel layers ({', '.join(sliced[:3])}) cannot be checkpointed: every tp "
                "rank's slice would be saved under the dense name; checkpoint the TP model under pp.DDP"
            )
        out: dict[str, ShardedArray | Array] = {}
        for unit in self.units:
            out.update(unit.shard.layout.views(unit.shard.data))
        out.update(self._replicated())
        return out

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Copy ``state`` (as returned by :meth:`sharded_state_dict`, possibly refilled) into the shards."""
        self._discard_prefetches()
        mine = self.sharded_state_dict()
        for key, target in mine.items():
            if key not in state:
                raise ValueError(f"FSDP.load_sharded_state_dict: missing key {key!r}")
            value = state[key]
            if isinstance(target, ShardedArray):
                if not isinstance(value, ShardedArray) or (value.global_shape, value.start, value.stop) != (
                    target.global_shape,
                    target.start,
                    target.stop,
                ):
                    raise ValueError(
                        f"FSDP.load_sharded_state_dict: {key!r} does not cover this rank's range"
                    )
                if value.local is not target.local:
                    target.local[...] = on_module(array_module(target.local), value.local)
            else:
                target[...] = on_module(array_module(target), value)

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Full parameters (master dtype) in the module inside; writes are kept; resharded after."""
        self.finish_gradient_sync()
        for unit in self.units:
            self._release(unit)
            self._use(unit, self._xp.asarray(self._gather_master(unit)))
        try:
            yield
        finally:
            for unit in self.units:
                assert unit.full is not None
                self._keep_shard(unit, unit.full)
                self._release(unit)
