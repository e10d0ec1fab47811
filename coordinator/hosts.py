"""The host calls: a host agent (``paramplane launch``) speaks for its ranks in one call per host.

Each call is the per-rank call done for every rank it carries, against the same state machine: a host's
joins, the latest heartbeat of each of its ranks, its ranks' arrivals at one barrier. Per-rank outcomes
travel back as ``CallError`` messages that the agent turns into each rank's own gRPC error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from paramplane.coordinator.model import Assignment, ErrorKind, Joiner, StateError
from paramplane.coordinator.state import CoordinatorState
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos.records import RankInfo
from paramplane.protos.stats import stats_of

UNSETTLED = object()
"""The outcome of a waiter not answered yet."""


class WaiterGroup:
    """The waiters of one host call (a host's joins or barrier arrivals): one future for all of them, set once
    every waiter has its outcome (or at the first error when ``fail_fast``), so that releasing thousands of
    ranks wakes one task per host instead of one per rank."""

    def __init__(
        self,
        size: int,
        fut: asyncio.Future[None],
        fail_fast: bool,
        on_done: Callable[[list[object]], None] | None = None,
    ) -> None:
        self.outcomes: list[object] = [UNSETTLED] * size
        self._left = size
        self.fut = fut
        self._fail_fast = fail_fast
        self._on_done = on_done

    def expire(self) -> None:
        """The call's backstop: the state machine failed to answer its waiters in time (an internal error)."""
        if not self.fut.done():
            self.fut.set_exception(asyncio.TimeoutError())

    def settle(self, slots: Sequence[int], outcome: object) -> None:
        """``outcome`` for each of ``slots`` not settled yet."""
        outcomes = self.outcomes
        for slot in slots:
            if outcomes[slot] is UNSETTLED:
                outcomes[slot] = outcome
                self._left -= 1
        if not self.fut.done() and (self._left == 0 or (self._fail_fast and isinstance(outcome, StateError))):
            self.fut.set_result(None)
            if self._left == 0 and self._on_done is not None:
                self._on_done(self.outcomes)


@dataclass
class Shared:
    """One waiter for ``size`` slots (a host's arrivals at one barrier): ``register(waiter)`` registers them all
    under it and answers each slot's refusal (None: registered); the waiter's outcome settles the others."""

    size: int
    register: Callable[[int], Sequence[StateError | None]]


Registers = list[Callable[[int], None]] | Shared
"""What ``Blocking.enter_many`` registers: one waiter per slot, or one ``Shared`` waiter for every slot."""


@dataclass
class Blocked:
    """The waiters of one host call, registered (``Blocking.enter_many``) and not yet withdrawn."""

    group: WaiterGroup
    waiters: list[tuple[int, Sequence[int]]]  # each waiter and the slots it settles
    backstop: asyncio.TimerHandle


class Blocking(Protocol):
    """The service's waits in two halves, for a host call that registers before its task first runs."""

    def enter_many(
        self,
        registers: Registers,
        limit_s: float,
        *,
        fail_fast: bool = False,
        on_done: Callable[[list[object]], None] | None = None,
    ) -> Blocked: ...

    async def wait_many(self, blocked: Blocked) -> list[object]: ...

    def leave_many(self, blocked: Blocked) -> None: ...


class BlockMany(Protocol):
    """The service's ``_block_many``: registers waiters, answers each one's value or ``StateError`` in order."""

    def __call__(
        self, registers: Registers, limit_s: float, *, fail_fast: bool = False
    ) -> Awaitable[list[object]]: ...


def call_error(e: StateError) -> pb.CallError:
    """A refused per-rank call, as the host call answers it."""
    return pb.CallError(
        code=e.kind.name,
        details=str(e),
        abort_rank=e.rank if e.kind is ErrorKind.ABORTED else -1,
        left_rank=e.left,
        mismatch=e.mismatch,
    )


def join_response(a: Assignment, interval_s: float, timeout_s: float) -> pb.JoinResponse:
    """One rank's JoinResponse fields (the peer table is added by the caller, serialized once per world)."""
    return pb.JoinResponse(
        rank=a.rank,
        world_size=a.world_size,
        node_rank=a.node_rank,
        num_nodes=a.num_nodes,
        local_rank=a.local_rank,
        local_world_size=a.local_world_size,
        epoch=a.epoch,
        heartbeat_interval_s=interval_s,
        heartbeat_timeout_s=timeout_s,
        job_id=a.job_id,
    )


def peers_wire(peers: tuple[RankInfo, ...]) -> bytes:
    """The peer table as the wire bytes of a JoinResponse holding only it."""
    return pb.JoinResponse(peers=[p.to_message() for p in peers]).SerializeToString()


def assignment_wire(
    a: Assignment, peers_wire: bytes, heartbeat_interval_s: float, heartbeat_timeout_s: float
) -> bytes:
    """A JoinResponse on the wire: this rank's fields, then the world's peer table serialized once for every
    joiner (protobuf concatenation merges them): O(ranks) per join instead of building the table again."""
    own = join_response(a, heartbeat_interval_s, heartbeat_timeout_s)
    return own.SerializeToString() + peers_wire


def serialize_join(response: pb.JoinResponse | pb.JoinHostResponse | bytes) -> bytes:
    """The Join and JoinHost handlers' response serializer: they answer wire bytes (see ``assignment_wire``)."""
    return response if isinstance(response, bytes) else response.SerializeToString()


async def join_host(
    state: CoordinatorState,
    block: BlockMany,
    request: pb.JoinHostRequest,
    interval_s: float,
    timeout_s: float,
    table_wire: Callable[[tuple[RankInfo, ...]], bytes],
) -> bytes:
    """Join every joiner of the request; answers once the world formed (one failure fails them all), as wire
    bytes: the members, then the peer table that ``table_wire`` serialized once for every host."""
    if not request.joiners:
        raise StateError(ErrorKind.INVALID_ARGUMENT, "a host join needs at least one joiner")

    def joining(j: pb.JoinRequest) -> Callable[[int], None]:
        joiner = Joiner(j.instance_id, j.host_id, j.peer_address, j.rank_hint, j.world_size, j.pid)
        return lambda w: state.join(joiner, w, time.monotonic())

    # Every joiner or none: the first failure answers the call and withdraws the others' joins.
    assignments = await block([joining(j) for j in request.joiners], state.join_timeout_s, fail_fast=True)
    failed = next((a for a in assignments if isinstance(a, StateError)), None)
    if failed is not None:
        raise failed
    members = []
    for a in assignments:
        assert isinstance(a, Assignment)
        members.append(join_response(a, interval_s, timeout_s))
    first = assignments[0]
    assert isinstance(first, Assignment)
    return pb.JoinHostResponse(members=members).SerializeToString() + table_wire(first.peers)


def heartbeat_host(state: CoordinatorState, request: pb.HeartbeatHostRequest) -> pb.HeartbeatHostResponse:
    """Record every beat of the request, each as the rank's own heartbeat carried by the host's agent."""
    if not request.host_id:
        raise StateError(ErrorKind.INVALID_ARGUMENT, "a host heartbeat needs the agent's host_id")
    now = time.monotonic()
    results = []
    for beat in request.beats:
        progress = {p.group: (p.issued, p.completed) for p in beat.progress}
        stats = stats_of(beat.stats) if beat.HasField("stats") else None
        try:
            abort = state.heartbeat(beat.epoch, beat.rank, progress, now, stats, agent=request.host_id)
        except StateError as e:
            results.append(pb.HeartbeatResult(error=call_error(e)))
            continue
        if abort is None:
            response = pb.HeartbeatResponse(aborted=False, rank=-1)
        else:
            response = pb.HeartbeatResponse(
                aborted=True, reason=abort.reason, rank=abort.rank, lost=abort.lost
            )
        results.append(pb.HeartbeatResult(response=response))
    return pb.HeartbeatHostResponse(results=results)


async def barrier_host(
    state: CoordinatorState, block: BlockMany, request: pb.BarrierHostRequest
) -> pb.BarrierHostResponse:
    """Every arriving rank of the request arrives at the barrier; answers each arrival's outcome."""
    return barrier_response(await block(barrier_arrivals(state, request), request.timeout_s))


def barrier_arrivals(state: CoordinatorState, request: pb.BarrierHostRequest) -> Shared:
    """The host's arrivals as one registration with the state (one waiter for all of them), for ``block`` /
    ``Blocking.enter_many``."""
    arriving = list(request.arriving)

    def register(waiter: int) -> Sequence[StateError | None]:
        return state.barrier_many(
            request.epoch,
            request.name,
            arriving,
            list(request.ranks),
            request.timeout_s,
            waiter,
            time.monotonic(),
        )

    return Shared(len(arriving), register)


_RELEASED: dict[int, pb.BarrierHostResponse] = {}  # by arrivals: every rank released (read only, shared)


def barrier_response(outcomes: list[object]) -> pb.BarrierHostResponse:
    """The arrivals' outcomes, in order: a release (no error) or the rank's error. Not to be modified: a
    release of every arrival is one message per host size, shared."""
    if any(isinstance(o, StateError) for o in outcomes):
        ok = pb.CallError()
        return pb.BarrierHostResponse(
            errors=[call_error(o) if isinstance(o, StateError) else ok for o in outcomes]
        )
    released = _RELEASED.get(len(outcomes))
    if released is None:
        released = pb.BarrierHostResponse(errors=[pb.CallError()] * len(outcomes))
        if len(_RELEASED) < 64:
            _RELEASED[len(outcomes)] = released
    return released
