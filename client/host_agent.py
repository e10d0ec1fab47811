"""The host agent: ``paramplane launch`` speaks to the coordinator for all of its host's ranks.

The launcher serves the Coordinator service on a Unix socket (``PARAMPLANE_AGENT``, in a private folder,
the job token checked as at the coordinator); its ranks' own ``CoordinatorClient`` calls go there. Upstream,
the agent makes one call per host where the ranks would make one each:

- joins arriving together go out as one ``JoinHost`` (the peer table comes back once);
- heartbeats are kept (the latest per rank) and go out as one ``HeartbeatHost`` per interval; a rank that
  stops beating is left out, so the coordinator names it at its timeout as before;
- one ``Watch`` stream per epoch, relayed to every local rank's stream; aborts also answer heartbeats;
- a barrier's local arrivals go out as one call; concurrent waiting gets of one key as one call; these and the
  ranks' unique-id sets go as messages on one ``HostCalls`` stream (``agent_stream.py``), answered on it (or as
  unary calls, ``BarrierHost`` and relays, to a coordinator without it);
- a rank process killed by a signal (the launcher's child) is reported at once as lost (``Abort``, ``lost``).

A lost agent (the launcher killed) silences all its ranks: the coordinator names the host's agent.
Every other call is relayed as it came, its answer or error (code, details, trailers) returned untouched
(``agent_relay.py``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from paramplane.agent_relay import Relayed, RelayServicer, quiet
from paramplane.agent_stream import HostCallStream, PendingCall, Unsupported, upstream_kv
from paramplane.node.coord_client import WAIT_MARGIN_S, CoordinatorClient
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos.net import within

__all__ = ["BARRIER_WINDOW_S", "JOIN_WINDOW_S", "HostAgent", "Relayed"]

log = logging.getLogger("paramplane.agent")

JOIN_WINDOW_S = 0.5
"""Joins arriving within this long of the first one go out together (at once when every local rank joined)."""
BARRIER_WINDOW_S = 0.02
"""Arrivals at one barrier within this long go out together (at once when every local participant arrived)."""


STREAMS_READY_S = 2.0
"""How long a join's answer waits for the host's streams (watch, host calls) to open before going out anyway."""

_BarrierKey = tuple[int, str, tuple[int, ...]]  # epoch, name, the ranks the arrival passed


@dataclass
class _Epoch:
    """A world this host's ranks joined through the agent."""

    ranks: dict[int, int]  # rank -> pid
    world_size: int
    interval_s: float
    abort: pb.HeartbeatResponse | None = None


@dataclass
class _Hub:
    """One upstream Watch stream of an epoch, replayed to every local subscriber."""

    events: list[pb.WatchEvent] = field(default_factory=list)
    queues: list[asyncio.Queue[pb.WatchEvent | Relayed]] = field(default_factory=list)
    error: Relayed | None = None
    task: asyncio.Task[None] | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # the first event (or the error) came


class HostAgent(RelayServicer):
    """The Coordinator service of one host's ranks, in front of the real coordinator (on one event loop)."""

    def __init__(self, upstream: CoordinatorClient, *, host_id: str, num_local: int) -> None:
        super().__init__(upstream)
        self.host_id = host_id
        self._num_local = num_local
        self.num_calls: collections.Counter[str] = collections.Counter()
        self._joins: list[tuple[pb.JoinRequest, float, asyncio.Future[tuple[pb.JoinResponse, bytes]]]] = []
        self._join_flush: asyncio.TimerHandle | None = None
        self._epochs: dict[int, _Epoch] = {}
        self._beats: dict[tuple[int, int], pb.HeartbeatRequest] = {}
        self._refused: dict[tuple[int, int], Relayed] = {}
        self._upstream_error: Relayed | None = None
        self._hubs: dict[int, _Hub] = {}
        self._barriers: dict[_BarrierKey, list[tuple[pb.BarrierRequest, asyncio.Future[Relayed | None]]]] = {}
        self._barrier_flush: dict[_BarrierKey, asyncio.TimerHandle] = {}
        self._barrier_local: dict[_BarrierKey, int] = {}  # a waiting barrier's local participants
        self._beating: asyncio.Task[None] | None = None
        self._host_stream = HostCallStream(upstream)

    def start(self) -> None:
        """Start the heartbeat loop (on the running loop)."""
        self._beating = asyncio.ensure_future(self._beat_forever())

    async def stop(self) -> None:
        tasks = [t for t in (self._beating, *self._tasks, *(h.task for h in self._hubs.values())) if t]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._host_stream.close()
        await self._up.close()

    # -- joins ------------------------------------------------------------------------------------
    async def Join(  # type: ignore[override]  # wire bytes, as the coordinator's Join
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        member, peers = await self._answer(context, self.join(request, self._left_s(context, 300.0)))
        return bytes(member.SerializeToString() + peers)

    async def join(self, request: pb.JoinRequest, timeout_s: float) -> tuple[pb.JoinResponse, bytes]:
        """One local rank's join, batched with the others: its place (without the peer table) and the peer table
        as the wire bytes of a JoinResponse holding only it (concatenated, they are the rank's answer)."""
        fut: asyncio.Future[tuple[pb.JoinResponse, bytes]] = quiet(asyncio.get_running_loop().create_future())
        self._joins.append((request, time.monotonic() + timeout_s, fut))
        if len(self._joins) >= self._num_local:
            self._flush_joins()
        elif self._join_flush is None:
            self._join_flush = asyncio.get_running_loop().call_later(JOIN_WINDOW_S, self._flush_joins)
        return await asyncio.shield(fut)

    def _flush_joins(self) -> None:
        if self._join_flush is not None:
            self._join_flush.cancel()
            self._join_flush = None
        batch, self._joins = self._joins, []
        if batch:
            self._spawn(self._join_batch(batch))

    async def _join_batch(
        self, batch: list[tuple[pb.JoinRequest, float, asyncio.Future[tuple[pb.JoinResponse, bytes]]]]
    ) -> None:
        timeout_s = max(min(deadline for _, deadline, _ in batch) - time.monotonic(), 0.001)
        try:
            response = await self._up.join_host([r for r, _, _ in batch], timeout_s=timeout_s)
        except grpc.aio.AioRpcError as e:
            for _, _, fut in batch:
                if not fut.done():
                    fut.set_exception(Relayed.of(e))
            return
        # The host's streams are open before its ranks start: their first calls do not wait behind the opening.
        first = response.members[0]
        self._host_stream.open()
        streams = (self._hub(first.epoch, first.rank).ready.wait(), self._host_stream.wait_open())
        with contextlib.suppress(asyncio.TimeoutError):
            await within(asyncio.gather(*streams), STREAMS_READY_S)
        peers = pb.JoinResponse(peers=response.peers).SerializeToString()
        for (request, _, fut), member in zip(batch, response.members, strict=True):
            epoch = self._epochs.get(member.epoch)
            if epoch is None:
                epoch = self._epochs[member.epoch] = _Epoch(
                    {}, member.world_size, member.heartbeat_interval_s
                )
            epoch.ranks[member.rank] = request.pid
            if not fut.done():
                fut.set_result((member, peers))
        for old in [e for e in self._epochs if e < max(self._epochs) - 1]:
            del self._epochs[old]

    # -- heartbeats -------------------------------------------------------------------------------
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        key = (request.epoch, request.rank)
        self._beats[key] = request
        refused = self._refused.pop(key, None) or self._upstream_error
        if refused is not None:
            await context.abort(refused.code, refused.details, trailing_metadata=refused.trailers)
        epoch = self._epochs.get(request.epoch)
        if epoch is not None and epoch.abort is not None:
            return epoch.abort
        return pb.HeartbeatResponse(aborted=False, rank=-1)

    async def _beat_forever(self) -> None:
        while True:
            interval = min((e.interval_s for e in self._epochs.values()), default=1.0)
            await asyncio.sleep(max(interval, 0.05))
            if self._beats:
                try:
                    await self._beat_once()
                except Exception:  # never let the host go silent over one bad answer
                    log.exception("host heartbeat failed")

    async def _beat_once(self) -> None:
        beats, self._beats = self._beats, {}
        try:
            response = await self._up.heartbeat_host(self.host_id, list(beats.values()))
        except grpc.aio.AioRpcError as e:
            self._upstream_error = Relayed.of(e)
            for key, beat in beats.items():
                self._beats.setdefault(key, beat)  # still this rank's latest: it goes with the next call
            log.warning("host heartbeat failed: %s", e.details())
            return
        self._upstream_error = None
        for key, result in zip(beats, response.results, strict=True):
            if result.HasField("error"):
                self._refused[key] = Relayed.of_call(result.error)
            elif result.response.aborted and (epoch := self._epochs.get(key[0])) is not None:
                epoch.abort = result.response

    async def rank_died(self, pid: int, how: str) -> None:
        """The launcher saw rank process ``pid`` end with a failure (``how``): name its rank lost at once."""
        for number in sorted(self._epochs, reverse=True):
            epoch = self._epochs[number]
            rank = next((r for r, p in epoch.ranks.items() if p == pid), None)
            if rank is None:
                continue
            self._beats.pop((number, rank), None)
            if epoch.abort is not None:
                return
            reason = f"rank {rank} (pid {pid}, host {self.host_id}) {how}: its launcher saw the process end"
            request = pb.AbortRequest(epoch=number, rank=rank, reason=reason, lost=True)
            try:
                await self._up.relay("Abort", request, timeout_s=5.0)
            except grpc.aio.AioRpcError as e:  # the coordinator's heartbeat timeout still names the rank
                log.warning("could not report rank %d's death: %s", rank, e.details())
            return

    # -- watch ------------------------------------------------------------------------------------
    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEvent]:
        hub = self._hub(request.epoch, request.rank)
        queue: asyncio.Queue[pb.WatchEvent | Relayed] = asyncio.Queue()
        for event in hub.events:
            queue.put_nowait(event)
        if hub.error is not None:
            queue.put_nowait(hub.error)
        hub.queues.append(queue)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Relayed):
                    await context.abort(item.code, item.details, trailing_metadata=item.trailers)
                    return
                event = pb.WatchEvent()
                event.CopyFrom(item)
                if event.kind == pb.WatchEvent.MEMBERSHIP:
                    event.rank = request.rank
                yield event
                if event.kind in (pb.WatchEvent.ABORT, pb.WatchEvent.SHUTDOWN):
                    return
        finally:
            hub.queues.remove(queue)

    def _hub(self, epoch: int, rank: int) -> _Hub:
        """The epoch's upstream Watch stream (subscribed as ``rank``), opened if it is not yet."""
        hub = self._hubs.get(epoch)
        if hub is None:
            hub = self._hubs[epoch] = _Hub()
            hub.task = asyncio.ensure_future(self._relay_watch(pb.WatchRequest(epoch=epoch, rank=rank), hub))
            for old in [e for e in self._hubs if e < epoch - 1]:
                dropped = self._hubs.pop(old)
                if dropped.task is not None:
                    dropped.task.cancel()
        return hub

    async def _relay_watch(self, request: pb.WatchRequest, hub: _Hub) -> None:
        stream = self._up.watch_as(request.epoch, request.rank)
        try:
            async for event in stream:
                hub.events.append(event)
                hub.ready.set()
                if event.kind == pb.WatchEvent.ABORT and (epoch := self._epochs.get(request.epoch)):
                    epoch.abort = pb.HeartbeatResponse(
                        aborted=True, reason=event.reason, rank=event.rank, lost=event.lost
                    )
                for queue in hub.queues:
                    queue.put_nowait(event)
        except grpc.aio.AioRpcError as e:
            hub.error = Relayed.of(e)
            for queue in hub.queues:
                queue.put_nowait(hub.error)
        finally:
            hub.ready.set()
            stream.cancel()

    # -- barriers and waiting gets ----------------------------------------------------------------
    async def Barrier(
        self, request: pb.BarrierRequest, context: grpc.aio.ServicerContext
    ) -> pb.BarrierResponse:
        epoch = self._epochs.get(request.epoch)
        if epoch is None:  # not a world of ours: the coordinator says what is wrong
            await self._answer(context, self._up.relay("Barrier", request, timeout_s=self._left_s(context)))
            return pb.BarrierResponse()
        # Arrivals passing different ranks go up apart: the coordinator names the mismatch, as for direct ranks.
        key = (request.epoch, request.name, tuple(request.ranks))
        # The arrival's own future, answered with its error or None: no shield, no exception to retrieve (a
        # rank that went away cancels only its own), one wake-up per rank on release.
        fut: asyncio.Future[Relayed | None] = asyncio.get_running_loop().create_future()
        arrivals = self._barriers.get(key)
        if arrivals is None:  # the first local arrival counts the local participants, once per barrier
            arrivals = self._barriers[key] = []
            everyone = set(request.ranks) if request.ranks else range(epoch.world_size)
            self._barrier_local[key] = sum(r in everyone for r in epoch.ranks)
        arrivals.append((request, fut))
        if len(arrivals) >= self._barrier_local[key]:
            self._flush_barrier(key)
        elif key not in self._barrier_flush:
            self._barrier_flush[key] = asyncio.get_running_loop().call_later(
                BARRIER_WINDOW_S, self._flush_barrier, key
            )
        error = await fut
        if error is not None:
            await context.abort(error.code, error.details, trailing_metadata=error.trailers)
        return pb.BarrierResponse()

    def _flush_barrier(self, key: _BarrierKey) -> None:
        timer = self._barrier_flush.pop(key, None)
        if timer is not None:
            timer.cancel()
        arrivals = self._barriers.pop(key, [])
        self._barrier_local.pop(key, None)
        if arrivals:
            self._spawn(self._barrier_batch(arrivals, *self._barrier_submit(arrivals)))

    def _barrier_submit(
        self, arrivals: list[tuple[pb.BarrierRequest, asyncio.Future[Relayed | None]]]
    ) -> tuple[pb.BarrierHostRequest, PendingCall | None]:
        """The host's arrivals as one request, sent on the host stream now if it can be (on a host lane: before
        the batch's task first runs), with its release handed to the ranks as soon as it is read."""
        first = arrivals[0][0]
        request = pb.BarrierHostRequest(
            epoch=first.epoch,
            name=first.name,
            arriving=[r.rank for r, _ in arrivals],
            ranks=first.ranks,
            timeout_s=first.timeout_s,
        )

        def on_answer(answer: pb.HostAnswer) -> None:
            if answer.HasField("barrier"):
                _release(arrivals, answer.barrier)

        if not self._host_stream.supported:
            return request, None
        try:
            call = pb.HostCall(barrier=request)
            return request, self._host_stream.submit(call, request.timeout_s + WAIT_MARGIN_S, on_answer)
        except Unsupported:
            return request, None

    async def _barrier_batch(
        self,
        arrivals: list[tuple[pb.BarrierRequest, asyncio.Future[Relayed | None]]],
        request: pb.BarrierHostRequest,
        submitted: PendingCall | None,
    ) -> None:
        try:
            _release(arrivals, await self._barrier_upstream(request, submitted))
        except (grpc.aio.AioRpcError, Relayed) as e:
            failed = Relayed.of(e) if isinstance(e, grpc.aio.AioRpcError) else e
            for _, fut in arrivals:
                if not fut.done():
                    fut.set_result(failed)

    async def _barrier_upstream(
        self, request: pb.BarrierHostRequest, submitted: PendingCall | None
    ) -> pb.BarrierHostResponse:
        """The answer to the host's arrivals: on the host stream when they were submitted there, else the unary
        call."""
        if submitted is not None:
            try:
                answer = await self._host_stream.answer(submitted)
            except Unsupported:
                pass  # the coordinator refused the stream after the call was submitted
            else:
                if answer.HasField("error"):
                    raise Relayed.of_call(answer.error)
                return answer.barrier
        return await self._up.barrier_host(request)

    async def _kv_upstream(self, method: str, request: Any, timeout_s: float) -> Any:
        return await upstream_kv(self._host_stream, self._up, method, request, timeout_s)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> Any:
        self._beats.pop((request.epoch, request.rank), None)
        return await self._relay("Leave", request, context)


def _release(
    arrivals: list[tuple[pb.BarrierRequest, asyncio.Future[Relayed | None]]], response: pb.BarrierHostResponse
) -> None:
    """Each waiting rank its outcome (a rank answered already is left as it is)."""
    for (_, fut), error in zip(arrivals, response.errors, strict=True):
        if not fut.done():
            fut.set_result(Relayed.of_call(error) if error.code else None)
