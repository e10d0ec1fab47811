"""The rank grid: which ranks share a host, derived once from the coordinator's peer table.

Every group is derived from one ``Topology`` passed explicitly (no globals).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paramplane.protos.records import RankInfo

__all__ = ["RankInfo", "Topology"]


@dataclass(frozen=True)
class Topology:
    """The world's ranks and hosts; ``ranks[i].rank == i``."""

    ranks: tuple[RankInfo, ...]

    def __post_init__(self) -> None:
        assert all(info.rank == i for i, info in enumerate(self.ranks)), "peer table must be indexed by rank"

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def host_of(self, rank: int) -> str:
        return self.ranks[rank].host_id

    def hosts(self, ranks: Sequence[int]) -> list[list[int]]:
        """``ranks`` split by host, hosts in node order, ranks ascending within each."""
        by_host: dict[int, list[int]] = {}
        for r in sorted(ranks):
            by_host.setdefault(self.ranks[r].node_rank, []).append(r)
        return [by_host[node] for node in sorted(by_host)]

    def same_host(self, ranks: Sequence[int]) -> bool:
        return len({self.ranks[r].host_id for r in ranks}) == 1

    def hierarchy(self, ranks: Sequence[int]) -> tuple[list[list[int]], list[list[int]]] | None:
        """Intra-host and cross-host subgroups of ``ranks`` for hierarchical collectives.

        Returns ``(local_groups, cross_groups)``: ``local_groups[h]`` are the ranks on host h and
        ``cross_groups[i]`` the i-th rank of every host. None when the split does not apply: a single
        host, one rank per host, or hosts holding different numbers of the group's ranks.
        """
        local = self.hosts(ranks)
        sizes = {len(h) for h in local}
        if len(local) < 2 or len(sizes) != 1 or sizes == {1}:
            return None
        (per_host,) = sizes
        cross = [[h[i] for h in local] for i in range(per_host)]
        return local, cross
