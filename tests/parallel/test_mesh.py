"""The rank grid: coordinates, rank order, and which members each group gets (no network)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from paramplane.group import ProcessGroup
from paramplane.node.engine import GroupEngine
from paramplane.parallel.mesh import Mesh


class _Ctx:
    def __init__(self) -> None:
        self.created: list[list[int]] = []

    def new_group(self, ranks: list[int], timeout_s: float | None = None) -> Any:
        self.created.append(list(ranks))
        return _engine(ranks, self.me, self)


class _Engine(SimpleNamespace):
    new_subgroup = GroupEngine.new_subgroup  # the engine's own member checks, over the fake context


def _engine(ranks: list[int], me: int, ctx: _Ctx) -> Any:
    ctx.me = me  # type: ignore[attr-defined]
    return _Engine(
        ranks=list(ranks), rank=ranks.index(me), size=len(ranks), name=f"g{ranks}", timeout_s=5.0, ctx=ctx
    )


def _world(size: int, me: int) -> tuple[ProcessGroup, _Ctx]:
    ctx = _Ctx()
    return ProcessGroup(_engine(list(range(size)), me, ctx)), ctx


def test_standard_names_put_tp_fastest_and_pp_slowest() -> None:
    world, _ = _world(8, 5)
    mesh = Mesh(world, tp=2, dp=2, pp=2)  # keyword order does not matter
    assert mesh.names == ("pp", "dp", "tp")
    assert mesh.coords == {"pp": 1, "dp": 0, "tp": 1}
    assert [mesh.rank_of(pp=p, dp=d, tp=t) for p in (0, 1) for d in (0, 1) for t in (0, 1)] == list(range(8))
    for r in range(8):
        assert mesh.rank_of(**mesh.coords_of(r)) == r


def test_groups_hold_the_ranks_that_agree_elsewhere() -> None:
    world, ctx = _world(8, 5)
    mesh = Mesh(world, dp=2, pp=2, tp=2)
    assert mesh.group("tp").ranks == [4, 5]
    assert mesh.group("dp").ranks == [5, 7]
    assert mesh.group("pp").ranks == [1, 5]
    assert mesh.group(("dp", "tp")).ranks == [4, 5, 6, 7]
    assert mesh.group("tp").rank == mesh.coordinate("tp")
    assert mesh.group("tp") is mesh.group("tp")  # cached: created once per member set
    assert ctx.created.count([4, 5]) == 1
    assert mesh.group(("pp", "dp", "tp")) is world  # the whole mesh is the base group itself


def test_custom_dimensions_and_neighbors() -> None:
    world, _ = _world(4, 2)
    mesh = Mesh(world, dims=[("replicate", 2), ("shard", 2)])
    assert mesh.coords == {"replicate": 1, "shard": 0}
    assert mesh.group("shard").ranks == [2, 3]
    assert mesh.group("replicate").ranks == [0, 2]
    assert mesh.neighbors("replicate") == (0, None)
    assert mesh.neighbors("shard") == (None, 1)


def test_bad_meshes_are_value_errors() -> None:
    world, _ = _world(4, 0)
    with pytest.raises(ValueError, match="product of the dimension sizes"):
        Mesh(world, dp=3)
    with pytest.raises(ValueError, match="unknown mesh dimensions"):
        Mesh(world, ep=4)
    with pytest.raises(ValueError, match="positive integer"):
        Mesh(world, dims=[("a", 0), ("b", 4)])
    with pytest.raises(ValueError, match="repeat"):
        Mesh(world, dims=[("a", 2), ("a", 2)])
    with pytest.raises(ValueError, match="no dimension 'tp'"):
        Mesh(world, dp=4).group("tp")
    with pytest.raises(ValueError, match="World or a ProcessGroup"):
        Mesh(object(), dp=4)
