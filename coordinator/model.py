"""Values the coordinator's state machine trades in, and the rank assignment (pure)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from paramplane.protos.records import RankInfo


class ErrorKind(enum.Enum):
    """Why a call was refused; the names are the gRPC status codes the server answers with."""

    INVALID_ARGUMENT = enum.auto()
    ALREADY_EXISTS = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    DEADLINE_EXCEEDED = enum.auto()
    ABORTED = enum.auto()
    UNAVAILABLE = enum.auto()


class StateError(Exception):
    """A refused call. ``rank`` names the culprit of an abort; ``mismatch`` marks a barrier disagreement;
    ``left`` names a rank a barrier waited for that left the world (-1: none)."""

    def __init__(
        self, kind: ErrorKind, message: str, *, rank: int = -1, mismatch: bool = False, left: int = -1
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.rank = rank
        self.mismatch = mismatch
        self.left = left


@dataclass(frozen=True)
class Joiner:
    """One join request."""

    instance_id: str
    host_id: str
    peer_address: str
    rank_hint: int = -1
    world_size: int = 0
    pid: int = 0


@dataclass(frozen=True)
class RankStats:
    """A rank's cumulative counters, as its heartbeats carry them (see ``RankStats`` in coordinator.proto)."""

    bytes_by_transport: Mapping[str, int] = field(default_factory=dict)
    ops_by_transport: Mapping[str, int] = field(default_factory=dict)
    reported: bool = False
    step: int = 0
    loss: float = 0.0
    tokens: int = 0
    num_checkpoint_commits: int = 0
    checkpoint_commit_s: float = 0.0


@dataclass(frozen=True)
class Assignment:
    """What a joiner learns once the world has formed."""

    rank: int
    world_size: int
    node_rank: int
    num_nodes: int
    local_rank: int
    local_world_size: int
    epoch: int
    job_id: str
    peers: tuple[RankInfo, ...]


class EventKind(enum.Enum):
    MEMBERSHIP = enum.auto()
    ABORT = enum.auto()
    LEFT = enum.auto()
    SHUTDOWN = enum.auto()


@dataclass(frozen=True)
class Event:
    """A watch event; ``rank`` is -1 when no rank is named."""

    kind: EventKind
    epoch: int
    rank: int = -1
    reason: str = ""
    lost: bool = False
    """For ABORT: ``rank`` is gone or stuck (missed heartbeats, no progress), not a rank that chose to abort."""


@dataclass(frozen=True)
class Resolution:
    """Answer for one waiter: ``value`` (Assignment, None or bytes) unless ``error`` is set."""

    waiter: int
    value: object = None
    error: StateError | None = None


@dataclass
class Effects:
    resolved: list[Resolution] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    formed: tuple[Assignment, ...] = ()


def group_by_host(joiners: Sequence[Joiner]) -> list[list[Joiner]]:
    """Joiners (given in arrival order) as hosts in node order, each in local-rank order.

    Hosts are ordered by first arrival and, within a host, hinted joiners come
    first by hint, then the others by arrival. When every joiner gave a hint and
    each host's hints are one consecutive run, the hints are the ranks.
    """
    hosts: dict[str, list[Joiner]] = {}
    for joiner in joiners:
        hosts.setdefault(joiner.host_id, []).append(joiner)
    ranks = _ranks_from_hints(list(hosts.values()), len(joiners))
    if ranks is not None:
        ordered = sorted(hosts.values(), key=lambda g: min(ranks[j.instance_id] for j in g))
        return [sorted(g, key=lambda j: ranks[j.instance_id]) for g in ordered]
    return [sorted(g, key=lambda j: (j.rank_hint < 0, j.rank_hint)) for g in hosts.values()]


def _ranks_from_hints(hosts: list[list[Joiner]], size: int) -> dict[str, int] | None:
    """Instance id -> rank that keeps every valid hint, or None when the hints cannot be kept.

    The hints must be distinct ranks below ``size``. Joiners without a hint (a replacement from a multi-host
    launcher) take the free ranks: first the gaps among their host's hinted ranks, then the free ranks next to
    them, and joiners of hosts without any hint the lowest free ranks left. The result must give every host
    one consecutive run of ranks; else None (first-arrival order then decides).
    """
    hinted = [j.rank_hint for g in hosts for j in g if j.rank_hint >= 0]
    if len(set(hinted)) != len(hinted) or any(h >= size for h in hinted):
        return None
    free = set(range(size)) - set(hinted)
    ranks = {j.instance_id: j.rank_hint for g in hosts for j in g if j.rank_hint >= 0}
    unplaced: list[Joiner] = []
    for g in hosts:
        waiting = [j for j in g if j.rank_hint < 0]
        own = [j.rank_hint for j in g if j.rank_hint >= 0]
        if not own:
            unplaced.extend(waiting)
            continue
        lo, hi = min(own), max(own)
        while waiting:
            gaps = [r for r in range(lo, hi + 1) if r in free]
            if gaps:
                rank = gaps[0]
            elif hi + 1 in free:
                rank = hi = hi + 1
            elif lo - 1 in free:
                rank = lo = lo - 1
            else:
                return None
            free.discard(rank)
            ranks[waiting.pop(0).instance_id] = rank
    for joiner, rank in zip(unplaced, sorted(free)):
        ranks[joiner.instance_id] = rank
    for g in hosts:
        mine = [ranks[j.instance_id] for j in g]
        if max(mine) - min(mine) != len(g) - 1:
            return None
    return ranks


def assign_ranks(joiners: Sequence[Joiner], epoch: int, job_id: str) -> dict[str, Assignment]:
    """The world formed by ``joiners`` (in arrival order): instance id -> assignment."""
    hosts = group_by_host(joiners)
    placed = [(j, node, local) for node, host in enumerate(hosts) for local, j in enumerate(host)]
    peers = tuple(
        RankInfo(r, j.peer_address, j.host_id, node, local) for r, (j, node, local) in enumerate(placed)
    )
    return {
        j.instance_id: Assignment(
            rank=r,
            world_size=len(placed),
            node_rank=node,
            num_nodes=len(hosts),
            local_rank=local,
            local_world_size=len(hosts[node]),
            epoch=epoch,
            job_id=job_id,
            peers=peers,
        )
        for r, (j, node, local) in enumerate(placed)
    }
