"""A group's collective frames, sent and received on the thread that runs the op.

Read by the event loop, a frame costs two thread wake-ups (the loop's when it comes, then the op's
thread's), and a send issued from the op's thread one more (the loop's); on a busy 2-core host each
is tens to hundreds of microseconds, which is most of a small all-reduce. Here the op's thread writes
a frame itself when nothing is queued before it on the lane and the socket takes it at once (a small
frame; larger ones and the rest are written by the loop, in order), and reads the peers' frames
itself: from the lane the peer plane parked for the group's key (``node/direct_lane.py``), or, on
gRPC streams (TLS, ``PARAMPLANE_TCP_LANE=0``), from the inbox the loop fills. A small all-reduce
then wakes one thread when its peer's frame comes, or none when it came first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple

import numpy as np

from paramplane.node.algorithms.ring import Sink
from paramplane.node.errors import PeerLost, PlaneClosed, PlaneError
from paramplane.node.frame_template import frame_bytes, template_bytes
from paramplane.node.lane import LaneStream
from paramplane.node.loop import LoopThread
from paramplane.node.spec import OpSpec
from paramplane.protos import peer_pb2

# Payloads up to this size ride inside the frame header (such a frame is written from the op's thread first).
INLINE_BYTES = 64 << 10
MAX_TEMPLATES = 64  # frame templates kept per direction; a group that used more starts again from none


class _Template(NamedTuple):
    """A small frame of one kind (peer, op, dtype, shape, arg, step, size) but for its sequence number and
    payload (``node/frame_template.py``)."""

    header: peer_pb2.FrameHeader  # seq and inline_payload unset
    head: bytes
    tail: bytes


class ThreadChannel:
    """The ``FrameChannel`` of one group's collectives on the op's thread (see the module docstring).

    ``channel`` is the group's ``GrpcChannel`` (headers, checks, the plane); ``expired()`` the error of an op
    that ran out of time. One op at a time (the group's actor runs them in order)."""

    def __init__(self, channel: Any, loop: LoopThread, expired: Callable[[], PlaneError]) -> None:
        self.channel = channel
        self.plane = channel.plane
        self.key: str = channel.key
        self.n: int = channel.n
        self.index: int = channel.index
        self.loop = loop
        self._expired = expired
        self._sending: dict[int, list[concurrent.futures.Future[None]]] = {}
        self._takes: dict[int, Callable[[float], Any]] = {}
        self._lanes: dict[int, Any] = {}  # the parked lane of each peer read so far
        self._templates: tuple[dict[tuple[Any, ...], _Template], dict[tuple[Any, ...], _Template]] = ({}, {})
        self.deadline = 0.0

    def begin(self, deadline: float) -> ThreadChannel:
        """Start an op bounded by ``deadline`` (``time.monotonic()``)."""
        self.deadline = deadline
        return self

    # -- sends ---------------------------------------------------------------------------------------
    def send(self, idx: int, spec: OpSpec, step: int, payload: np.ndarray | None) -> None:
        # Sends that went out are forgotten; failed ones stay until ``flush`` raises them.
        queued = [f for f in self._sending.get(idx, ()) if not f.done() or f.exception() is not None]
        nbytes = payload.nbytes if payload is not None else 0
        lane = None
        if not queued and nbytes <= INLINE_BYTES:
            lane = self.plane.ready_lane(self.channel.ranks[idx], self.key)
        if lane is None:
            queued.append(
                self._sending_on_loop(self._after(list(queued), self.channel.send(idx, spec, step, payload)))
            )
        else:
            t = self._template(0, idx, spec, step, nbytes)
            data = payload.reshape(-1).view(np.uint8).data if payload is not None and nbytes else b""
            rest = lane.send_now(frame_bytes(t.head, t.tail, spec.seq, data))
            if rest:
                queued.append(self._sending_on_loop(self._send_rest(lane, rest)))
        self._sending[idx] = queued

    @staticmethod
    async def _after(queued: list[concurrent.futures.Future[None]], send: Coroutine[Any, Any, None]) -> None:
        """``send`` once the sends queued before it to the same peer went out: concurrent sends on the loop
        could otherwise reach the lane's lock in another order (one waiting for the lane to open, the next
        not) and a peer would read step 2 before step 0."""
        try:
            for earlier in queued:
                await asyncio.wrap_future(earlier)
        except BaseException:
            send.close()
            raise
        await send

    async def _send_rest(self, lane: LaneStream, rest: bytes) -> None:
        try:
            await lane.send_raw([rest])
        except PeerLost as exc:
            raise self.channel.fail(exc) from None

    def _on_loop(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        try:
            return self.loop.submit(coro)
        except RuntimeError:  # the loop has stopped
            coro.close()
            raise self.plane.failure(self.key) or self._closed() from None

    def _sending_on_loop(self, coro: Coroutine[Any, Any, None]) -> concurrent.futures.Future[None]:
        """A send the loop writes; its failure fails the key here at once (a receive waiting meanwhile raises
        it instead of waiting out the deadline)."""
        fut = self._on_loop(coro)
        fut.add_done_callback(self._send_done)
        return fut

    def _send_done(self, fut: concurrent.futures.Future[None]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if isinstance(exc, PlaneError):
            self.loop.call_soon(self.plane.fail_key, self.key, exc)

    @staticmethod
    def _closed() -> PlaneError:
        return PlaneClosed("the plane was shut down")

    def sent(self) -> bool:
        return all(f.done() for fs in self._sending.values() for f in fs)

    def flush(self) -> None:
        sending = [f for fs in self._sending.values() for f in fs]
        pending = [f for f in sending if not f.done()]
        if pending:
            concurrent.futures.wait(
                pending, max(0.0, self.deadline - time.monotonic()), concurrent.futures.FIRST_EXCEPTION
            )
        for f in sending:
            if f.done() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        if any(not f.done() for f in pending):
            raise self._timed_out()
        self._sending.clear()

    # -- receives ------------------------------------------------------------------------------------
    def _template(self, incoming: int, idx: int, spec: OpSpec, step: int, nbytes: int) -> _Template:
        """The template of a small frame of ``spec`` to (``incoming``: from) group index ``idx``."""
        kinds = self._templates[incoming]
        key = (idx, spec.op, spec.dtype, spec.shape, spec.arg, step, nbytes)
        t = kinds.get(key)
        if t is None:
            if len(kinds) >= MAX_TEMPLATES:
                kinds.clear()
            header = self.channel.template(idx, spec, nbytes, incoming=bool(incoming))
            header.step = step
            t = kinds[key] = _Template(header, *template_bytes(header))
        return t

    def recv(self, idx: int, spec: OpSpec, step: int, nbytes: int, sink: Sink) -> None:
        take = self._takes.get(idx) or self._take(idx)
        first = None
        try:
            lane = self._lanes.get(idx)
            if lane is not None and nbytes <= INLINE_BYTES:  # a small frame as expected is taken unparsed
                t = self._template(1, idx, spec, step, nbytes)
                try:
                    item = lane.next_message(self.deadline - time.monotonic(), t.head, t.tail, nbytes)
                except PeerLost as exc:
                    self._fail_soon(exc)
                    raise
                if type(item) is not tuple:
                    first = item
                elif item[0] == spec.seq:
                    if nbytes:
                        sink(0, item[1])
                    return
                else:  # out of turn: the checks name it
                    first = peer_pb2.FrameHeader(seq=item[0], inline_payload=bytes(item[1]))
                    first.MergeFrom(t.header)
            self.channel.recv_frame(
                take, idx, spec, step, nbytes, sink, self.deadline, self._fail_soon, first
            )
        except TimeoutError:
            raise self._timed_out() from None

    def _take(self, idx: int) -> Callable[[float], Any]:
        """How frames from group index ``idx`` are read here: its parked lane's ``next_item`` or its inbox's
        ``get_blocking`` (made on the loop, waited for up to the op's deadline, on first use)."""
        rank, plane, key = self.channel.ranks[idx], self.plane, self.key
        # The channel's own flag, not the plane's registry: the key's registration may not have reached the
        # loop yet when the group's first op runs.
        if plane.serves_lanes and self.channel.direct:
            lane = plane.direct.get(rank, key)
            if lane is None:
                lane = self._wait(plane.direct.wait(rank, key))
            self._lanes[idx] = lane
            take: Callable[[float], Any] = lane.next_item
        else:
            inbox = plane.existing_inbox(rank, key)
            if inbox is None:
                inbox = self._wait(_make_inbox(plane, rank, key))
            take = inbox.get_blocking
        self._takes[idx] = take
        return take

    def _wait(self, coro: Coroutine[Any, Any, Any]) -> Any:
        fut = self._on_loop(coro)
        try:
            return fut.result(max(0.0, self.deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise self._timed_out() from None

    def forget(self) -> None:
        """Drop the readers kept per peer (after the key failed, a re-formed plane has new ones)."""
        self._takes.clear()
        self._lanes.clear()

    def _timed_out(self) -> PlaneError:
        """The op ran out of time: fail the key here (on the loop) and raise."""
        exc = self._expired()
        self.loop.call_soon(self.plane.fail_key, self.key, exc)
        return exc

    def _fail_soon(self, exc: PlaneError) -> None:
        """Fail the key with ``exc`` here and on the other members (from the loop)."""
        self.loop.call_soon(self.channel.fail, exc)


async def _make_inbox(plane: Any, rank: int, key: str) -> Any:
    return plane.inbox(rank, key)
