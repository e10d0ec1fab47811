"""The Coordinator servicer: turns requests into CoordinatorState calls and state effects into answers.

Blocking calls wait on futures that the state machine resolves (in ``_flush``);
a ticker task drives the state's clock. No decisions are made here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from paramplane.coordinator.host_stream import HostStreams
from paramplane.coordinator.hosts import (
    UNSETTLED,
    Blocked,
    Registers,
    Shared,
    WaiterGroup,
    assignment_wire,
    barrier_host,
    heartbeat_host,
    join_host,
    peers_wire,
)
from paramplane.coordinator.model import (
    Assignment,
    Effects,
    ErrorKind,
    Event,
    EventKind,
    Joiner,
    StateError,
)
from paramplane.coordinator.state import CoordinatorState
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos import coordinator_pb2_grpc as pb_grpc
from paramplane.protos.auth import ABORT_RANK_METADATA_KEY, LEFT_RANK_METADATA_KEY, MISMATCH_METADATA_KEY
from paramplane.protos.net import within
from paramplane.protos.records import RankInfo
from paramplane.protos.stats import stats_of

log = logging.getLogger("paramplane.coordinator")

# A blocking call that the state machine failed to answer this long after its own deadline is an internal error.
_BACKSTOP_S = 5.0
_T = TypeVar("_T")

_EVENT_KINDS = {
    EventKind.MEMBERSHIP: pb.WatchEvent.MEMBERSHIP,
    EventKind.ABORT: pb.WatchEvent.ABORT,
    EventKind.LEFT: pb.WatchEvent.LEFT,
    EventKind.SHUTDOWN: pb.WatchEvent.SHUTDOWN,
}


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """The servicer: turns requests into state calls and state effects into answers and events."""

    def __init__(
        self, state: CoordinatorState, *, heartbeat_interval_s: float, heartbeat_timeout_s: float
    ) -> None:
        self._state = state
        self._heartbeat_interval_s = heartbeat_interval_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._waiters: dict[int, tuple[WaiterGroup, Sequence[int]]] = {}  # waiter -> its call's group, slots
        self._ids = itertools.count()
        self._watchers: set[asyncio.Queue[Event]] = set()
        self._wake = asyncio.Event()
        self._due = math.inf  # the ticker's next wake-up
        self._ticker: asyncio.Task[None] | None = None
        self._host_peers: tuple[tuple[RankInfo, ...], bytes] | None = None
        self.num_calls: collections.Counter[str] = collections.Counter()
        """Calls answered, by method name (counted by the server's handlers)."""
        self._peers_wire: tuple[tuple[RankInfo, ...], bytes] | None = None  # the last table, serialized
        self._hosts = HostStreams(state, self, self._block, self._sync, self.num_calls)
        self.lane_port = 0
        """The host lane's port offered to agents on their ``HostCalls`` streams (0: none)."""

    @property
    def host_streams(self) -> HostStreams:
        """Every agent's host calls (the gRPC streams' and the host lanes')."""
        return self._hosts

    # -- effects ----------------------------------------------------------------------------------
    def _flush(self) -> None:
        effects: Effects = self._state.take_effects()
        for res in effects.resolved:
            slot = self._waiters.get(res.waiter)
            if slot is not None:
                slot[0].settle(slot[1], res.value if res.error is None else res.error)
        if effects.formed:
            hosts = sorted({p.host_id for p in effects.formed[0].peers})
            log.info(
                "world formed: %d ranks on %d hosts %s, job %s",
                len(effects.formed),
                len(hosts),
                hosts,
                effects.formed[0].job_id,
            )
        for event in effects.events:
            if event.kind is EventKind.ABORT:
                log.error("world aborted: %s", event.reason)
            else:
                log.info("%s", event.reason)
            for queue in self._watchers:
                queue.put_nowait(event)

    async def _block(self, register: Callable[[int], None], limit_s: float) -> object:
        """Register a waiter with the state and wait for its resolution (or withdraw it if the caller leaves)."""
        (outcome,) = await self._block_many([register], limit_s)
        if isinstance(outcome, StateError):
            raise outcome
        return outcome

    async def _block_many(
        self,
        registers: Registers,
        limit_s: float,
        *,
        fail_fast: bool = False,
    ) -> list[object]:
        """``_block`` for several waiters at once (a host call): each one's value or ``StateError``, in order.
        With ``fail_fast``, the first error answers at once and the others are withdrawn."""
        return await self.wait_many(self.enter_many(registers, limit_s, fail_fast=fail_fast))

    def enter_many(
        self,
        registers: Registers,
        limit_s: float,
        *,
        fail_fast: bool = False,
        on_done: Callable[[list[object]], None] | None = None,
    ) -> Blocked:
        """``_block_many``'s first half, done before it returns: the waiters registered (and, when they complete
        what others waited for, everyone settled). ``wait_many`` waits for the outcomes and ``leave_many``
        withdraws what is left; one of the two must follow. ``on_done`` gets the outcomes as the last one is
        settled (synchronously, inside the state's effects), before ``wait_many`` resumes."""
        loop = asyncio.get_running_loop()
        shared, each = (registers, []) if isinstance(registers, Shared) else (None, registers)
        size = shared.size if shared is not None else len(each)
        group = WaiterGroup(size, loop.create_future(), fail_fast, on_done)
        earliest = time.monotonic() + limit_s  # no waiter of this call times out before it
        blocked = Blocked(group, [], loop.call_later(limit_s + _BACKSTOP_S, group.expire))
        try:
            if shared is not None:
                waiter = next(self._ids)
                slots = range(size)
                self._waiters[waiter] = (group, slots)
                blocked.waiters.append((waiter, slots))
                try:
                    refused: Sequence[StateError | None] = shared.register(waiter)
                except StateError as e:
                    refused = [e] * size
                for slot, error in enumerate(refused):
                    if error is not None:
                        group.settle((slot,), error)
            for slot, register in enumerate(each):
                if group.fut.done():
                    break  # failed fast: the rest never arrive
                waiter = next(self._ids)
                self._waiters[waiter] = (group, (slot,))
                blocked.waiters.append((waiter, (slot,)))
                try:
                    register(waiter)
                except StateError as e:
                    group.settle((slot,), e)
            self._flush()
        except BaseException:
            self.leave_many(blocked)
            raise
        if earliest < self._due:
            self._wake.set()  # a deadline before the ticker's next wake-up: it wakes earlier
        return blocked

    async def wait_many(self, blocked: Blocked) -> list[object]:
        """The outcomes of ``enter_many``'s waiters, in order (each a value or ``StateError``)."""
        try:
            await blocked.group.fut
            return blocked.group.outcomes
        except asyncio.TimeoutError:
            raise StateError(
                ErrorKind.DEADLINE_EXCEEDED, "the coordinator missed its own deadline (internal error)"
            ) from None
        finally:
            self.leave_many(blocked)

    def leave_many(self, blocked: Blocked) -> None:
        """Withdraw ``enter_many``'s waiters not settled yet (once; later calls do nothing)."""
        blocked.backstop.cancel()
        withdrawn = False
        outcomes = blocked.group.outcomes
        for waiter, slots in blocked.waiters:
            del self._waiters[waiter]
            if any(outcomes[slot] is UNSETTLED for slot in slots):
                self._state.cancel(waiter)
                withdrawn = True
        blocked.waiters.clear()
        if withdrawn:
            self._flush()

    async def _guard(self, context: grpc.aio.ServicerContext, work: Awaitable[_T]) -> _T:
        try:
            return await work
        except StateError as e:
            trailers: tuple[tuple[str, str], ...] = ()
            if e.kind is ErrorKind.ABORTED:
                trailers = ((ABORT_RANK_METADATA_KEY, str(e.rank)),)
            elif e.mismatch:
                trailers = ((MISMATCH_METADATA_KEY, "1"),)
            elif e.left >= 0:
                trailers = ((LEFT_RANK_METADATA_KEY, str(e.left)),)
            await context.abort(grpc.StatusCode[e.kind.name], str(e), trailing_metadata=trailers)
            raise  # context.abort raised already

    async def _sync(self, fn: Callable[[], _T]) -> _T:
        result = fn()
        self._flush()
        return result

    # -- ticker -----------------------------------------------------------------------------------
    def start_ticker(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(
            self._tick_forever(), name="paramplane-coordinator-tick"
        )

    async def stop_ticker(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    async def _tick_forever(self) -> None:
        # A full tick (O(ranks)) every period or at a deadline; a waiter due before the next wake-up (_wake) only
        # moves it: calls with longer timeouts (most) do not wake the ticker at all.
        period = self._heartbeat_interval_s / 4
        next_tick = 0.0
        while True:
            now = time.monotonic()
            deadline = self._state.next_deadline()
            if now >= next_tick or (deadline is not None and deadline <= now):
                try:
                    self._state.tick(now)
                    self._flush()
                except Exception:
                    log.exception("coordinator tick failed")
                next_tick = now + period
                deadline = self._state.next_deadline()
            due = self._due = next_tick if deadline is None else min(next_tick, deadline)
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await within(self._wake.wait(), max(0.0, due - now))

    def shutdown(self) -> None:
        self._state.shutdown()
        self._flush()

    # -- RPCs -------------------------------------------------------------------------------------
    async def Join(  # type: ignore[override]  # wire bytes: see serialize_join
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        joiner = Joiner(
            instance_id=request.instance_id,
            host_id=request.host_id,
            peer_address=request.peer_address,
            rank_hint=request.rank_hint,
            world_size=request.world_size,
            pid=request.pid,
        )
        log.debug("join: host %s pid %d rank hint %d", joiner.host_id, joiner.pid, joiner.rank_hint)
        work = self._block(
            lambda w: self._state.join(joiner, w, time.monotonic()), self._state.join_timeout_s
        )
        assignment = await self._guard(context, work)
        assert isinstance(assignment, Assignment)
        if self._peers_wire is None or self._peers_wire[0] is not assignment.peers:
            self._peers_wire = (assignment.peers, peers_wire(assignment.peers))
        return assignment_wire(
            assignment, self._peers_wire[1], self._heartbeat_interval_s, self._heartbeat_timeout_s
        )

    async def KVSet(self, request: pb.KVSetRequest, context: grpc.aio.ServicerContext) -> pb.KVSetResponse:
        await self._guard(
            context, self._sync(lambda: self._state.kv_set(request.epoch, request.key, request.value))
        )
        return pb.KVSetResponse()

    async def KVGet(self, request: pb.KVGetRequest, context: grpc.aio.ServicerContext) -> pb.KVGetResponse:
        if not request.wait:
            value = await self._guard(
                context, self._sync(lambda: self._state.kv_get(request.epoch, request.key))
            )
            return pb.KVGetResponse(found=value is not None, value=value or b"")
        work = self._block(
            lambda w: self._state.kv_wait(request.epoch, request.key, request.timeout_s, w, time.monotonic()),
            request.timeout_s,
        )
        found = await self._guard(context, work)
        assert isinstance(found, bytes)
        return pb.KVGetResponse(found=True, value=found)

    async def KVAdd(self, request: pb.KVAddRequest, context: grpc.aio.ServicerContext) -> pb.KVAddResponse:
        value = await self._guard(
            context, self._sync(lambda: self._state.kv_add(request.epoch, request.key, request.delta))
        )
        return pb.KVAddResponse(value=value)

    async def KVCompareSet(
        self, request: pb.KVCompareSetRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVCompareSetResponse:
        expected = None if request.expect_absent else request.expected
        swapped, current = await self._guard(
            context,
            self._sync(
                lambda: self._state.kv_compare_set(request.epoch, request.key, expected, request.desired)
            ),
        )
        return pb.KVCompareSetResponse(swapped=swapped, present=current is not None, current=current or b"")

    async def KVDelete(
        self, request: pb.KVDeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVDeleteResponse:
        deleted = await self._guard(
            context, self._sync(lambda: self._state.kv_delete(request.epoch, request.key))
        )
        return pb.KVDeleteResponse(deleted=deleted)

    async def Barrier(
        self, request: pb.BarrierRequest, context: grpc.aio.ServicerContext
    ) -> pb.BarrierResponse:
        def register(waiter: int) -> None:
            self._state.barrier(
                request.epoch,
                request.name,
                request.rank,
                list(request.ranks),
                request.timeout_s,
                waiter,
                time.monotonic(),
            )

        await self._guard(context, self._block(register, request.timeout_s))
        return pb.BarrierResponse()

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        progress = {p.group: (p.issued, p.completed) for p in request.progress}
        stats = stats_of(request.stats) if request.HasField("stats") else None
        abort = await self._guard(
            context,
            self._sync(
                lambda: self._state.heartbeat(request.epoch, request.rank, progress, time.monotonic(), stats)
            ),
        )
        if abort is None:
            return pb.HeartbeatResponse(aborted=False, rank=-1)
        return pb.HeartbeatResponse(aborted=True, reason=abort.reason, rank=abort.rank, lost=abort.lost)

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEvent]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            pending = await self._guard(
                context, self._sync(lambda: self._state.snapshot_events(request.epoch, request.rank))
            )
            while True:
                event = pending.pop(0) if pending else await queue.get()
                yield pb.WatchEvent(
                    kind=_EVENT_KINDS[event.kind],
                    epoch=event.epoch,
                    rank=event.rank,
                    reason=event.reason,
                    lost=event.lost,
                )
                if event.kind in (EventKind.ABORT, EventKind.SHUTDOWN):
                    return
        finally:
            self._watchers.discard(queue)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._guard(
            context,
            self._sync(
                lambda: self._state.abort(request.epoch, request.rank, request.reason, lost=request.lost)
            ),
        )
        return pb.AbortResponse()

    def status(self) -> pb.StatusResponse:
        """The world now, as ``paramplane status`` and the live view show it."""
        status = self._state.status(time.monotonic())
        return pb.StatusResponse(
            ranks=[pb.RankStatus(**r) for r in status.pop("ranks", [])],
            groups=[pb.GroupStatus(**g) for g in status.pop("groups", [])],
            history=[pb.ReportPoint(**p) for p in status.pop("history", [])],
            heartbeat_interval_s=self._heartbeat_interval_s,
            heartbeat_timeout_s=self._heartbeat_timeout_s,
            num_calls=dict(self.num_calls),
            **status,
        )

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        return self.status()

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        await self._guard(context, self._sync(lambda: self._state.leave(request.epoch, request.rank)))
        return pb.LeaveResponse()

    # -- host calls (coordinator/hosts.py) --------------------------------------------------------
    async def JoinHost(  # type: ignore[override]  # wire bytes: see serialize_join
        self, request: pb.JoinHostRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        work = join_host(
            self._state,
            self._block_many,
            request,
            self._heartbeat_interval_s,
            self._heartbeat_timeout_s,
            self._host_peers_wire,
        )
        return await self._guard(context, work)

    def _host_peers_wire(self, peers: tuple[RankInfo, ...]) -> bytes:
        """The world's peer table as the wire bytes of a JoinHostResponse holding only it (once per world)."""
        if self._host_peers is None or self._host_peers[0] is not peers:
            wire = pb.JoinHostResponse(peers=[p.to_message() for p in peers]).SerializeToString()
            self._host_peers = (peers, wire)
        return self._host_peers[1]

    async def HeartbeatHost(
        self, request: pb.HeartbeatHostRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatHostResponse:
        return await self._guard(context, self._sync(lambda: heartbeat_host(self._state, request)))

    async def BarrierHost(
        self, request: pb.BarrierHostRequest, context: grpc.aio.ServicerContext
    ) -> pb.BarrierHostResponse:
        return await self._guard(context, barrier_host(self._state, self._block_many, request))

    async def HostCalls(  # type: ignore[override]  # answers are written (context.write), not yielded
        self, request_iterator: AsyncIterator[pb.HostCall], context: grpc.aio.ServicerContext
    ) -> None:
        await self._hosts.serve(request_iterator, context, self.lane_port)
