"""RankStats between its wire form and the coordinator's model (both sides use these)."""

from __future__ import annotations

from paramplane.coordinator.model import RankStats
from paramplane.protos import coordinator_pb2 as pb


def stats_pb(stats: RankStats) -> pb.RankStats:
    return pb.RankStats(
        bytes_by_transport=dict(stats.bytes_by_transport),
        ops_by_transport=dict(stats.ops_by_transport),
        reported=stats.reported,
        step=stats.step,
        loss=stats.loss,
        tokens=stats.tokens,
        num_checkpoint_commits=stats.num_checkpoint_commits,
        checkpoint_commit_s=stats.checkpoint_commit_s,
    )


def stats_of(message: pb.RankStats) -> RankStats:
    return RankStats(
        bytes_by_transport=dict(message.bytes_by_transport),
        ops_by_transport=dict(message.ops_by_transport),
        reported=message.reported,
        step=message.step,
        loss=message.loss,
        tokens=message.tokens,
        num_checkpoint_commits=message.num_checkpoint_commits,
        checkpoint_commit_s=message.checkpoint_commit_s,
    )
