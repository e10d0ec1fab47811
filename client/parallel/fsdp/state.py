"""FSDP's state: full and sharded state dicts, loading them, and ``summon_full_params``, as functions over
the wrapper's units (the wrapper adds what its module path changes: keys, tensor values, tied aliases).

Frozen parameters (``requires_grad=False``) are not sharded (unless a torch module's ``use_orig_params`` puts them in
the units: ``fsdp.frozen``): like buffers they are replicated module state,
kept whole on every rank (broadcast from group rank 0 at wrap time with ``sync_module_states``), in the state
dicts under their names and, in ``sharded_state_dict``, as whole arrays (a checkpoint writes them once).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from paramplane.group import ProcessGroup
from paramplane.nn.module import Array, LoadResult
from paramplane.node.arrays import array_module, on_module
from paramplane.parallel.fsdp.gather import Gatherer
from paramplane.parallel.fsdp.units import FlatUnit
from paramplane.parallel.sharding import ShardedArray


def gather_master(unit: FlatUnit, shard_group: ProcessGroup, master_dtype: Any) -> Array:
    """The unit's full flat parameter in the master dtype (a collective on the shard group)."""
    if shard_group.size == 1:
        return unit.shard.data.copy()
    out = array_module(unit.shard.data).empty(unit.padded, master_dtype)
    shard_group.all_gather(unit.shard.data, out=out)
    return out


def full_values(units: list[FlatUnit], shard_group: ProcessGroup, master_dtype: Any) -> dict[str, Array]:
    """Every sharded parameter's full value (a copy) by name, on every rank (collectives, unit by unit)."""
    values: dict[str, Array] = {}
    for unit in units:
        full = gather_master(unit, shard_group, master_dtype)
        for name, p, off in zip(unit.names, unit.params, unit.offsets):
            values[name] = full[off : off + p.size].reshape(p.shape).copy()
    return values


def keep_shard(unit: FlatUnit, flat: Array, shard_rank: int) -> None:
    """Copy this rank's piece of the full flat parameter ``flat`` into its shard (wherever that lives)."""
    lo = shard_rank * unit.shard_size
    unit.shard.data[...] = on_module(array_module(unit.shard.data), flat[lo : lo + unit.shard_size])


def load_full(
    units: list[FlatUnit],
    state: dict[str, Array],
    replicated: dict[str, Array],
    gather: Gatherer,
    master_dtype: Any,
    shard_rank: int,
    strict: bool = True,
) -> LoadResult:
    """Load a full state dict (sharded parameters by name, and the ``replicated`` arrays' keys): every rank
    keeps its shard (no communication). ``strict=False`` loads the keys present and keeps the rest, returning
    the keys skipped (as torch's ``load_state_dict``)."""
    gather.discard_prefetches()
    wanted = {n: p.shape for u in units for n, p in zip(u.names, u.params)}
    missing = sorted((set(wanted) | set(replicated)) - set(state))
    unexpected = sorted(set(state) - set(wanted) - set(replicated))
    if strict and (missing or unexpected):
        raise ValueError(f"FSDP.load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    for key, shape in [*wanted.items(), *((k, tuple(b.shape)) for k, b in replicated.items())]:
        if key in state and tuple(state[key].shape) != tuple(shape):
            raise ValueError(
                f"FSDP.load_state_dict: {key!r} has shape {tuple(state[key].shape)}, expected {shape}"
            )
    for unit in units:
        present = [i for i, name in enumerate(unit.names) if name in state]
        if not present:
            continue
        gather.release(unit)
        xp = array_module(unit.shard.data)
        flat = xp.zeros(unit.padded, master_dtype)
        given = xp.zeros(unit.padded, bool)
        for i in present:
            off, size = unit.offsets[i], unit.params[i].size
            flat[off : off + size] = on_module(xp, state[unit.names[i]]).reshape(-1)
            given[off : off + size] = True
        if len(present) == len(unit.names):
            keep_shard(unit, flat, shard_rank)
        else:  # only the given parameters' elements of this rank's piece change
            lo = shard_rank * unit.shard_size
            mine = given[lo : lo + unit.shard_size]
            unit.shard.data[mine] = flat[lo : lo + unit.shard_size][mine]
    for key, buf in replicated.items():
        if key in state:
            buf[...] = on_module(array_module(buf), state[key])
    return LoadResult(missing, unexpected)


def sharded_views(units: list[FlatUnit], replicated: dict[str, Array]) -> dict[str, ShardedArray | Array]:
    """This rank's pieces as ``ShardedArray`` views into the live shards, plus the ``replicated`` arrays
    (frozen parameters and buffers, whole). Replicas (no_shard, hybrid) hold equal ranges; a writer keeps
    one of them."""
    sliced = [n for unit in units for n, p in zip(unit.names, unit.params) if getattr(p, "shard", None)]
    if sliced:
        raise ValueError(
            f"FSDP over tensor-parallel layers ({', '.join(sliced[:3])}) cannot be checkpointed: every tp "
            "rank's slice would be saved under the dense name; checkpoint the TP model under pp.DDP"
        )
    out: dict[str, ShardedArray | Array] = {}
    for unit in units:
        out.update(unit.shard.layout.views(unit.shard.data))
    out.update(replicated)
    return out


def load_sharded(mine: dict[str, ShardedArray | Any], state: dict[str, Any]) -> None:
    """Copy ``state`` (a sharded state dict, possibly refilled) into ``mine`` (this rank's live views)."""
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
                raise ValueError(f"FSDP.load_sharded_state_dict: {key!r} does not cover this rank's range")
            if value.local is not target.local:
                target.local[...] = on_module(array_module(target.local), value.local)
        else:
            target[...] = on_module(array_module(target), value)


@contextlib.contextmanager
def summon_full_params(
    units: list[FlatUnit],
    gather: Gatherer,
    master_dtype: Any,
    xp: ModuleType,
    finish_gradient_sync: Callable[[], None],
    writeback: bool = True,
) -> Iterator[None]:
    """Full parameters (master dtype) in the module inside; writes are kept (``writeback``); resharded after."""
    finish_gradient_sync()
    for unit in units:
        gather.release(unit)
        gather.use(unit, xp.asarray(gather_master(unit, gather.shard_group, master_dtype)))
    try:
        yield
    finally:
        for unit in units:
            assert unit.full is not None
            if writeback:
                keep_shard(unit, unit.full, gather.shard_group.rank)
            gather.release(unit)
