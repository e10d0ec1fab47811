"""Records both sides of the coordinator API share: the coordinator assigns them, the ranks read them."""

from __future__ import annotations

from dataclasses import dataclass

from paramplane.protos import coordinator_pb2 as pb


@dataclass(frozen=True)
class RankInfo:
    """One row of the world's peer table (the coordinator's ``PeerInfo`` message)."""

    rank: int
    """The rank's index in the world."""
    address: str
    """``host:port`` of the rank's data-plane server."""
    host_id: str
    """The host it runs on (``PARAMPLANE_HOST_ID``, default the hostname)."""
    node_rank: int
    """Its host's index, hosts in order of their lowest rank."""
    local_rank: int
    """Its index among the ranks of its host."""

    def to_message(self) -> pb.PeerInfo:
        return pb.PeerInfo(
            rank=self.rank,
            address=self.address,
            host_id=self.host_id,
            node_rank=self.node_rank,
            local_rank=self.local_rank,
        )

    @classmethod
    def from_message(cls, message: pb.PeerInfo) -> RankInfo:
        return cls(message.rank, message.address, message.host_id, message.node_rank, message.local_rank)
