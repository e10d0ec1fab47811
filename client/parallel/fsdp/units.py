"""FSDP's flat units: one flat, padded parameter per unit, sharded over the shard group.

A unit owns a list of the model's parameters. Their elements are concatenated (in
``named_parameters`` order) into one flat buffer padded to a multiple of the shard-group
size ``S``; group rank ``r`` keeps elements ``[r * k, (r + 1) * k)`` with ``k = padded / S``
as its ``shard`` Parameter, which is what the optimizer sees. While a unit is gathered the
original parameters' ``data`` are views into the full buffer; while it is sharded they are
zero-stride placeholders of the right shape that hold no memory.

Building the units: a module path (the wrapper's, or the torch adapter's) names the default unit
modules and decides which unit owns each parameter (``choose_units``, ``owned_units``); ``build_units``
makes one ``FlatUnit`` per group of parameters, with values agreed on by every rank.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.module import Array, Module, Parameter
from paramplane.node.arrays import array_module, is_floating, to_pinned
from paramplane.node.errors import CollectiveMismatch
from paramplane.parallel.sharding import FlatLayout, LayoutEntry
from paramplane.work import Work


@dataclass(frozen=True)
class UnitsByClass:
    """``units=pp.units_by_class(Block, ...)``: every submodule of those classes is a unit (torch's
    ``ModuleWrapPolicy``). Units may nest: an inner unit owns its parameters, the outer one the rest."""

    classes: tuple[type, ...]

    def select(self, module: Any) -> list[Any]:
        found = [m for _, m in module.named_modules() if isinstance(m, self.classes) and m is not module]
        if not found:
            names = ", ".join(c.__name__ for c in self.classes)
            raise ValueError(
                f"units_by_class({names}): {type(module).__name__} has no submodule of those classes"
            )
        return found


def units_by_class(*classes: type) -> UnitsByClass:
    """A unit policy for ``FSDP(..., units=...)``: every submodule that is an instance of ``classes``."""
    if not classes or not all(isinstance(c, type) for c in classes):
        raise ValueError(f"units_by_class takes module classes, got {classes!r}")
    return UnitsByClass(tuple(classes))


def placeholder(shape: tuple[int, ...], dtype: Any, xp: Any) -> Array:
    """A read-only array of ``shape`` that holds one element, NaN for floating dtypes: a sharded parameter's
    ``data`` (a computation that reads it yields NaN, never plausible values)."""
    fill = xp.full((), np.nan, dtype) if is_floating(dtype) else xp.zeros((), dtype)
    return xp.broadcast_to(fill, shape)


def concat_params(params: Sequence[Parameter], size: int, dtype: Any) -> Array:
    """The parameters' current values, flattened and concatenated, zero-padded to ``size``."""
    xp = array_module(params[0].data)
    flat = xp.zeros(size, dtype)
    start = 0
    for p in params:
        flat[start : start + p.size] = p.data.reshape(-1)
        start += p.size
    return flat


@dataclass
class FlatUnit:
    """One FSDP unit (see the module docstring)."""

    name: str
    module: Module | None
    """The submodule whose forward/backward bracket the unit's use; None for the root unit."""
    names: list[str]
    params: list[Parameter]
    offsets: list[int]
    numel: int
    """Real elements (padding excluded)."""
    padded: int
    shard: Parameter
    """This rank's shard of the flat parameter, in the master dtype."""
    full: Array | None = None
    """The gathered flat parameter while gathered, else None."""
    gather_work: Work[Any] | None = None
    grad_work: Work[Any] | None = None
    grad_shard: Array | None = None
    """The reduce-scatter's output (this rank's gradient piece, reduce dtype); with one shard, the flat gradient."""
    replicate_work: Work[Any] | None = None
    forward_done: bool = False
    """Set by the unit's forward (the torch wrapper checks every unit's module was called)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def shard_size(self) -> int:
        return int(self.shard.data.size)

    @property
    def gathered(self) -> bool:
        return self.full is not None

    @classmethod
    def build(
        cls,
        name: str,
        module: Module | None,
        named: Sequence[tuple[str, Parameter]],
        shard_rank: int,
        shard_count: int,
        flat: Array,
    ) -> FlatUnit:
        """A unit over ``named`` whose full flat values are ``flat`` (already agreed on by every rank)."""
        params = [p for _, p in named]
        offsets, start = [], 0
        for p in params:
            offsets.append(start)
            start += p.size
        padded = math.ceil(start / shard_count) * shard_count
        k = padded // shard_count
        lo = shard_rank * k
        xp = array_module(flat)
        piece = xp.zeros(k, flat.dtype)
        real = max(0, min(lo + k, start) - lo)
        if real:
            piece[:real] = flat[lo : lo + real]
        entries = []
        for (pname, p), off in zip(named, offsets):
            # Every parameter gets an entry; one this shard does not reach gets an empty range.
            a = min(max(off, lo), off + p.size)
            b = max(a, min(off + p.size, lo + k))
            at = min(max(a - lo, 0), k)
            entries.append(LayoutEntry(pname, p.shape, a - off, at, b - a))
        shard = Parameter(piece, name=f"{name}.flat_shard")
        shard.layout = FlatLayout(tuple(entries), k)
        return cls(name, module, [n for n, _ in named], params, offsets, start, padded, shard)

    def flatten_grads(self, dtype: Any, xp: Any) -> Array:
        """The padded concatenation of the parameters' gradients (zeros where there is none)."""
        flat = xp.zeros(self.padded, dtype)
        for p, off in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[off : off + p.size] = p.grad.reshape(-1)
        return flat

    def use_full(self, full: Array) -> None:
        """Point every parameter's ``data`` at its piece of the gathered flat buffer."""
        self.full = full
        for p, off in zip(self.params, self.offsets):
            p.data = full[off : off + p.size].reshape(p.shape)

    def release_from(self, flat: Array) -> None:
        """After construction: the parameters stop holding their full values (placeholders)."""
        xp = array_module(flat)
        for p in self.params:
            p.data = placeholder(p.shape, flat.dtype, xp)
            p.grad = None

    def release(self) -> None:
        """Drop the gathered buffer; parameters become placeholders."""
        if self.full is None:
            return
        xp = array_module(self.full)
        for p in self.params:
            p.data = placeholder(p.shape, self.full.dtype, xp)
        self.full = None

    def drop_param_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def has_param_grads(self) -> bool:
        return any(p.grad is not None for p in self.params)


UnitGroup = tuple[str, Any, list[tuple[str, Parameter]]]
"""A unit's path, its module (None for the root unit) and the parameters it owns."""


def choose_units(
    module: Any, units: Sequence[Any] | UnitsByClass | None, default: Callable[[], list[tuple[str, Any]]]
) -> list[tuple[str, Any]]:
    """The unit modules with their paths: the ``default``, a ``units_by_class`` policy's or the given list."""
    if units is None:
        return default()
    if isinstance(units, UnitsByClass):
        units = units.select(module)
    paths = {id(m): path for path, m in module.named_modules()}
    chosen = []
    for m in units:
        if id(m) not in paths or m is module:
            raise ValueError("every unit must be a submodule of the wrapped module (not the module itself)")
        chosen.append((paths[id(m)], m))
    return chosen


def owned_units(chosen: list[tuple[str, Module]], named: list[tuple[str, Parameter]]) -> list[UnitGroup]:
    """(path, module, its parameters) per chosen unit of a ``paramplane.nn`` module (a unit owns its
    module's parameters; overlapping units are an error); the root unit (module None) holds the rest."""
    owner: dict[int, str] = {}
    groups: list[UnitGroup] = []
    by_id = {id(p): n for n, p in named}
    for path, m in chosen:
        mine = [(by_id[id(p)], p) for p in m.parameters() if id(p) in by_id]
        for _, p in mine:
            if id(p) in owner:
                raise ValueError(
                    f"units overlap: parameter {by_id[id(p)]!r} is in unit {owner[id(p)]!r} and in {path!r}"
                )
            owner[id(p)] = path
        if mine:
            groups.append((path, m, mine))
    rest = [(n, p) for n, p in named if id(p) not in owner]
    if rest:
        groups.append(("<root>", None, rest))
    return groups


def build_units(
    groups: list[UnitGroup],
    group: ProcessGroup,
    shard_group: ProcessGroup,
    master_dtype: Any,
    *,
    sync: bool,
    host_shards: bool,
) -> list[FlatUnit]:
    """One unit per group, sharded over ``shard_group``: with ``sync`` its values are group rank 0's; with
    ``host_shards`` (CPU offload of a cupy model) the shards are page-locked host arrays."""
    built = []
    s_rank, s_count = shard_group.rank, shard_group.size
    for path, unit_module, mine in groups:
        dtypes = {p.dtype for _, p in mine}
        if len(dtypes) != 1:
            raise ValueError(
                f"unit {path!r} mixes parameter dtypes {sorted(map(str, dtypes))}; FSDP needs one"
            )
        flat = concat_params([p for _, p in mine], sum(p.size for _, p in mine), master_dtype)
        if sync and group.size > 1:
            group.broadcast(flat, src=0)
        unit = FlatUnit.build(path, unit_module, mine, s_rank, s_count, flat)
        unit.release_from(flat)
        if host_shards:
            unit.shard.data = to_pinned(unit.shard.data)
        built.append(unit)
    return built


def check_same_model(group: ProcessGroup, named: list[tuple[str, Parameter]], what: str = "FSDP") -> None:
    """CollectiveMismatch naming the first parameter whose name, shape or dtype differs across ranks
    (``what``: the wrapper, for the message)."""
    if group.size == 1:
        return
    counts = group.all_gather(np.array([len(named)], np.int64))
    if len(set(counts.tolist())) != 1:
        raise CollectiveMismatch(
            f"{what}: ranks wrap models with different numbers of parameters: {dict(enumerate(counts.tolist()))} "
            f"(group ranks of '{group.name}'); every rank must wrap the same model"
        )
    sigs = np.array([zlib.crc32(f"{n}|{p.shape}|{p.dtype}".encode()) for n, p in named], np.int64)
    every = group.all_gather(sigs).reshape(group.size, -1)
    for i, (name, p) in enumerate(named):
        versions: dict[int, list[int]] = {}
        for r in range(group.size):
            versions.setdefault(int(every[r, i]), []).append(r)
        if len(versions) > 1:
            raise CollectiveMismatch(
                f"{what}: parameter {name!r} differs across the group ranks of '{group.name}': ranks "
                f"{' vs '.join(map(str, versions.values()))} hold different names, shapes or dtypes (here, group "
                f"rank {group.rank}: shape {p.shape}, {p.dtype}); every rank must wrap the same model"
            )
