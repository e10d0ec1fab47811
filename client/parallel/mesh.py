"""``Mesh``: one rank grid with named dimensions, the only place that does rank arithmetic.

Every parallel wrapper takes its groups from a mesh::

    mesh = pp.Mesh(world, dp=2, pp=2, tp=1)     # standard names: pp slowest, then dp, tp fastest
    mesh.group("tp"), mesh.group("dp"), mesh.group(("dp", "tp"))
    mesh.coordinate("pp"), mesh.neighbors("pp")

    hsdp = pp.Mesh(world.group, dims=[("replicate", 2), ("shard", 2)])   # any names, slowest first

Ranks are laid out row-major over the dimensions (the last one varies fastest), like
Megatron's default with tp fastest: tensor-parallel peers are consecutive ranks, so they
share a host when ranks are grouped by host, and pipeline stages lie furthest apart.
A group along some dimensions holds the ranks that agree on every other coordinate.
Groups are created on first use and cached per member set; only the members of a
group create it, so meshes work over any process group, not only the world.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from paramplane.group import ProcessGroup

STANDARD_ORDER = ("pp", "dp", "tp")
"""Slowest to fastest, for ``Mesh(world, dp=..., pp=..., tp=...)``."""


class Mesh:
    """A grid of the ranks of ``base`` (a World or a ProcessGroup) with named dimensions."""

    def __init__(
        self,
        base: Any,
        dims: Sequence[tuple[str, int]] | Mapping[str, int] | None = None,
        **sizes: int,
    ) -> None:
        group = base.group if not isinstance(base, ProcessGroup) and hasattr(base, "group") else base
        if not isinstance(group, ProcessGroup):
            raise ValueError(f"Mesh needs a World or a ProcessGroup, got {type(base).__name__}")
        if dims is not None and sizes:
            raise ValueError(
                "pass the dimensions either as dims=[(name, size), ...] or as keywords, not both"
            )
        if dims is None:
            unknown = sorted(set(sizes) - set(STANDARD_ORDER))
            if unknown:
                raise ValueError(
                    f"unknown mesh dimensions {unknown}: the keyword form takes {', '.join(STANDARD_ORDER)}; "
                    "use dims=[(name, size), ...] for other names"
                )
            pairs = [(name, sizes[name]) for name in STANDARD_ORDER if name in sizes]
        else:
            pairs = list(dims.items()) if isinstance(dims, Mapping) else [tuple(d) for d in dims]  # type: ignore[misc]
        if not pairs:
            raise ValueError("a mesh needs at least one dimension")
        names = [str(n) for n, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh dimension names repeat: {names}")
        for name, size in pairs:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh dimension {name!r} must have a positive integer size, got {size!r}")
        shape = tuple(int(s) for _, s in pairs)
        if math.prod(shape) != group.size:
            described = " x ".join(f"{n}={s}" for n, s in zip(names, shape))
            raise ValueError(
                f"mesh {described} holds {math.prod(shape)} ranks but group '{group.name}' has {group.size}; "
                "the product of the dimension sizes must equal the group size"
            )
        self.base = group
        self.names: tuple[str, ...] = tuple(names)
        self.shape: tuple[int, ...] = shape
        self._coords = self.coords_of(group.rank)
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}

    # -- geometry ---------------------------------------------------------------------------------
    def size(self, name: str | None = None) -> int:
        """The size of dimension ``name``, or the number of ranks in the mesh."""
        return self.shape[self._axis(name)] if name is not None else math.prod(self.shape)

    def coords_of(self, rank: int) -> dict[str, int]:
        """The coordinates of base-group rank ``rank``."""
        if not 0 <= rank < math.prod(self.shape):
            raise ValueError(f"rank {rank} is not in this mesh of {math.prod(self.shape)} ranks")
        coords: dict[str, int] = {}
        for name, size in zip(reversed(self.names), reversed(self.shape)):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in self.names}

    def rank_of(self, **coords: int) -> int:
        """The base-group rank at ``coords`` (missing dimensions: this rank's coordinate)."""
        unknown = sorted(set(coords) - set(self.names))
        if unknown:
            raise ValueError(f"unknown mesh dimensions {unknown}; this mesh has {list(self.names)}")
        rank = 0
        for name, size in zip(self.names, self.shape):
            c = coords.get(name, self._coords[name])
            if not 0 <= c < size:
                raise ValueError(f"coordinate {name}={c} is outside [0, {size})")
            rank = rank * size + c
        return rank

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinates."""
        return dict(self._coords)

    def coordinate(self, name: str) -> int:
        """This rank's coordinate along ``name``."""
        return self._coords[self.names[self._axis(name)]]

    def neighbors(self, name: str) -> tuple[int | None, int | None]:
        """Previous and next rank along ``name`` as indices of ``group(name)`` (None at the ends).

        For a pipeline dimension these are the stages before and after this one.
        """
        c, n = self.coordinate(name), self.size(name)
        return (c - 1 if c > 0 else None), (c + 1 if c + 1 < n else None)

    # -- groups -----------------------------------------------------------------------------------
    def group(self, names: str | Sequence[str]) -> ProcessGroup:
        """The group of ranks that differ from this one only along ``names``.

        Group rank order is mesh order over those dimensions, so ``group(name).rank`` equals
        ``coordinate(name)``.
        """
        along = [names] if isinstance(names, str) else list(names)
        axes = {self._axis(n) for n in along}
        members = [r for r in range(self.size()) if self._agrees_off(r, axes)]
        key = tuple(members)
        if key not in self._groups:
            if len(members) == self.base.size:
                self._groups[key] = self.base
            else:
                self._groups[key] = self.base.new_subgroup(members)
        return self._groups[key]

    def _agrees_off(self, rank: int, axes: set[int]) -> bool:
        theirs = self.coords_of(rank)
        return all(theirs[n] == self._coords[n] for i, n in enumerate(self.names) if i not in axes)

    def _axis(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise ValueError(f"this mesh has no dimension {name!r}; it has {list(self.names)}") from None

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"Mesh({dims}; rank {self.base.rank} at {self._coords})"
