"""Point-to-point messages of one group: a line per peer and direction, paired in issue order.

Messages to a peer are numbered per direction and go out in issue order: a small one with nothing
queued before it leaves from the calling thread at once, the rest is written by the event loop.
A blocking receive with nothing queued before it reads its frame on the calling thread (from the
lane the peer plane parked for this key), so it wakes one thread when its message comes, or none
when it came first.

A pipeline's activations are made of such messages, and whatever a stage's thread does for one
after computing is idle time of the pipeline; the interpreter runs that code on cold caches, so
its cost is mostly how much code it touches. After the first message of a dtype and shape on a
line, the next ones take a short path (``send_small`` / ``recv_small``): the line keeps that
frame's header serialized (``_Template``), a message's frame is those bytes with its sequence
number and payload appended (protobuf fields may come in any order), and a received frame that is
byte for byte the expected header, a sequence number and a payload of the expected size is taken
without parsing it; any other frame is parsed and goes through the full checks, which name what
differs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, NamedTuple, TypeVar

import numpy as np

from paramplane.node.algorithms import ring
from paramplane.node.arrays import DTYPES, dtype_name
from paramplane.node.errors import PeerLost, PlaneClosed, PlaneError
from paramplane.node.frame_template import frame_bytes, template_bytes
from paramplane.node.lane import LaneStream
from paramplane.node.loop import on_daemon_thread
from paramplane.node.spec import OpSpec
from paramplane.node.transports.grpc import INLINE_BYTES, GrpcTransport
from paramplane.protos import peer_pb2

T = TypeVar("T")
# Header templates kept per line (one per dtype and shape that line carried); a line that carries more
# starts again from none.
MAX_TEMPLATES = 64
Begin = Callable[[int], OpSpec]  # the spec of message number ``seq``, called when the message's turn comes
Spec = Callable[[Any, int, int, int], OpSpec]  # (array, src, dst, seq) -> spec, as GroupEngine.p2p_spec


class _Template(NamedTuple):
    """The frame of a message of one dtype and shape on a line but for its sequence number and payload
    (``node/frame_template.py``)."""

    header: peer_pb2.FrameHeader  # seq and inline_payload unset
    head: bytes  # ``header`` serialized, then the tag of its seq field
    tail: bytes  # the tag and the length of the inline payload
    dtype: np.dtype[Any]
    shape: tuple[int, ...]


class _Line:
    """Messages to or from one peer: the last message number, how many are queued on the loop, and the
    frame template of each dtype and shape the line carried (``recent``: the last one used).

    ``seq`` advances under ``lock`` on a caller's thread while nothing is queued, and on the loop for queued
    messages (which run only while ``pending`` > 0, when no caller's thread advances it)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a future done already runs ``_done`` inside ``track``
        self.pending = 0
        self.seq = 0
        self.templates: dict[tuple[np.dtype[Any], tuple[int, ...]], _Template] = {}
        self.recent: _Template | None = None
        self.lane: LaneStream | None = None  # a send line's open lane, once a message went out on it

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def track(self, fut: concurrent.futures.Future[T]) -> concurrent.futures.Future[T]:
        """Count ``fut`` as queued until it is done (call with ``lock`` held)."""
        self.pending += 1
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _fut: concurrent.futures.Future[Any]) -> None:
        with self.lock:
            self.pending -= 1

    def remember(self, dtype: np.dtype[Any], header: peer_pb2.FrameHeader) -> _Template:
        """Keep ``header`` (seq and payload unset) as the template of arrays of ``dtype`` and its shape."""
        if len(self.templates) >= MAX_TEMPLATES:
            self.templates.clear()
        shape = tuple(header.shape)
        template = _Template(header, *template_bytes(header), dtype, shape)
        self.templates[(dtype, shape)] = self.recent = template
        return template


class GrpcPointToPoint(GrpcTransport):
    """The ``PointToPoint`` of one group over the peer plane (host arrays); see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tails: dict[Hashable, asyncio.Future[Any]] = {}
        self._send_lines: dict[int, _Line] = {}
        self._recv_lines: dict[int, _Line] = {}

    # -- ordering on the loop ----------------------------------------------------------------------
    def submit_in_order(
        self, line: Hashable, make: Callable[[], Awaitable[T]]
    ) -> concurrent.futures.Future[T]:
        """Run ``make()`` on the loop once every op submitted before it on ``line`` has finished.

        No thread waits in between: the caller gets a future at once and is woken by the loop itself.
        Each op is bounded by the group's timeout from when it starts; on expiry the key fails on
        every member, as in ``run``. From any thread but the loop's.
        """
        out: concurrent.futures.Future[T] = concurrent.futures.Future()

        def start() -> None:
            task = asyncio.ensure_future(self._in_order(self._tails.get(line), make, out))
            self._tails[line] = task
            task.add_done_callback(functools.partial(_cancelled, out))

        if not self.loop.call_soon(start):
            out.set_exception(PlaneClosed("the plane was shut down"))
        return out

    async def _in_order(
        self,
        before: asyncio.Future[Any] | None,
        make: Callable[[], Awaitable[T]],
        out: concurrent.futures.Future[T],
    ) -> None:
        """Settles ``out`` itself, not from the task's done callback: the waiting caller wakes one loop
        iteration sooner."""
        if before is not None and not before.done():
            await asyncio.wait([before])
        try:
            try:
                async with asyncio.timeout(self.timeout_s) as scope:
                    result = await make()
            except TimeoutError:
                if not scope.expired():
                    raise  # the op's own CollectiveTimeout
                exc = self._expired()
                self.plane.fail_key(self.key, exc)
                raise exc from None
        except Exception as exc:
            out.set_exception(exc)
            return
        out.set_result(result)

    # -- sends ---------------------------------------------------------------------------------------
    def send_small(
        self, x: np.ndarray, dst: int
    ) -> tuple[int, concurrent.futures.Future[None] | None] | None:
        """The short path of ``start_send`` for a C-contiguous ``x`` of a dtype and shape this line sent
        before from the calling thread: (its message number, None when it went out whole or the future of
        its rest, which the loop writes); None where the short path does not apply."""
        line = self._send_lines.get(dst)
        if line is None:
            return None
        template = line.templates.get((x.dtype, x.shape))
        lane = line.lane
        if template is None or lane is None:
            return None
        with line.lock:
            if line.pending or self.plane.closing or self.plane.failure(self.key) is not None:
                return None
            seq = line.next_seq()
            return seq, self._send_inline(line, lane, template, seq, x, dst)

    def start_send(self, flat: np.ndarray, dst: int, begin: Begin) -> concurrent.futures.Future[None] | None:
        """Send ``flat`` to group rank ``dst`` after every send before it there; ``begin(seq)`` gives the spec
        when the send's turn comes.

        A small message with nothing queued before it goes out from the calling thread at once (a
        pipeline's critical path is made of these): None then, as it is sent. The rest is written by the
        loop, in order.
        """
        line = _line_of(self._send_lines, dst)
        with line.lock:
            lane = self.plane.ready_lane(self.channel.ranks[dst], self.key) if line.pending == 0 else None
            if lane is None or flat.nbytes > INLINE_BYTES:
                return line.track(
                    self.submit_in_order(("send", dst), functools.partial(self._send, flat, line, dst, begin))
                )
            try:
                spec = begin(line.next_seq())
            except PlaneError as exc:
                failed: concurrent.futures.Future[None] = concurrent.futures.Future()
                failed.set_exception(exc)
                return failed
            template = line.remember(flat.dtype, self.channel.template(dst, spec, flat.nbytes))
            line.lane = lane
            return self._send_inline(line, lane, template, spec.seq, flat, dst)

    def _send_inline(
        self, line: _Line, lane: LaneStream, template: _Template, seq: int, x: np.ndarray, dst: int
    ) -> concurrent.futures.Future[None] | None:
        """Write message ``seq`` (``x`` in ``template``'s frame) from this thread (``line.lock`` held): None when
        the socket took it whole, else the future of its rest, which the loop writes before anything later."""
        rest = lane.send_now(frame_bytes(template.head, template.tail, seq, x.tobytes()))
        if not rest:
            return None
        return line.track(self.submit_in_order(("send", dst), functools.partial(self._send_rest, lane, rest)))

    async def _send(self, flat: np.ndarray, line: _Line, dst: int, begin: Begin) -> None:
        await self.channel.send(dst, begin(line.next_seq()), 0, flat)

    async def _send_rest(self, lane: LaneStream, rest: bytes) -> None:
        try:
            await lane.send_raw([rest])
        except PeerLost as exc:
            raise self.channel.fail(exc) from None

    # -- receives ------------------------------------------------------------------------------------
    def recv_small(self, x: np.ndarray | None, src: int, spec: Spec) -> tuple[int, np.ndarray] | None:
        """The short path of a blocking receive on the calling thread, into a C-contiguous, writable ``x`` of a
        dtype and shape this line received before, or (``x`` None) into a new array of the dtype and shape
        the header carries: (its message number, the array), or None where the short path does not apply.
        A header unlike the one expected goes through the full checks, which name what differs (``spec(x,
        src, dst, seq)`` names the message then)."""
        line = self._recv_lines.get(src)
        if line is None:
            return None
        # Into a new array: the frame is tried against the line's last kind of message.
        template = line.templates.get((x.dtype, x.shape)) if x is not None else line.recent
        lane = self.plane.direct.get(self.channel.ranks[src], self.key)
        if lane is None or (x is not None and template is None):
            return None
        with line.lock:
            if line.pending:
                return None
            seq = line.next_seq()
            header: Any
            try:
                if template is None:
                    header = lane.next_item(self.timeout_s)
                else:
                    item = lane.next_message(
                        self.timeout_s, template.head, template.tail, template.header.nbytes
                    )
                    if type(item) is tuple:
                        if item[0] == seq:
                            out = x if x is not None else np.empty(template.shape, template.dtype)
                            _write(out, item[1])
                            line.recent = template
                            return seq, out
                        header = peer_pb2.FrameHeader(seq=item[0], inline_payload=bytes(item[1]))
                        header.MergeFrom(template.header)  # the frame as sent, out of turn: checks name it
                    else:
                        header = item
            except TimeoutError:
                raise self._timed_out() from None
            except PeerLost as exc:
                self.fail_soon(exc)
                raise
            if type(header) is peer_pb2.FrameHeader and header.seq == seq:
                dtype = DTYPES.get(header.dtype)
                expected = template if x is not None else None
                if x is None and dtype is not None:
                    expected = line.templates.get((dtype, tuple(header.shape)))
                payload = header.inline_payload
                header.seq, header.inline_payload = 0, b""
                if expected is not None and header == expected.header and len(payload) == header.nbytes:
                    out = x if x is not None else np.empty(tuple(header.shape), dtype)
                    _write(out, payload)
                    line.recent = expected
                    return seq, out
                header.seq, header.inline_payload = seq, payload
            # Not the header expected: the full checks name what differs (or take a frame they accept).
            flat = x.reshape(-1) if x is not None else None
            named = spec(x, src, self.channel.index, seq)
            got = self._read(lane.next_item, flat, src, named, first=header)
            if x is None:
                self._remember(line, src, named, got, None)
            return seq, x if x is not None else got

    def start_recv(
        self, flat: np.ndarray | None, src: int, begin: Begin
    ) -> concurrent.futures.Future[np.ndarray]:
        """Receive from group rank ``src`` into ``flat`` (a new array shaped by the sender when None), after
        every receive before it from there."""
        line = _line_of(self._recv_lines, src)

        async def recv() -> np.ndarray:
            spec = begin(line.next_seq())
            if self.plane.is_direct(self.key):
                failure = self.plane.failure(self.key)
                if failure is not None:
                    raise failure
                lane = await self.plane.direct.wait(self.channel.ranks[src], self.key)
                # The read waits up to the group's timeout unless the lane fails.
                got = await on_daemon_thread(
                    self._read, lane.next_item, flat, src, spec, name="paramplane-p2p-recv"
                )
                self._remember(line, src, spec, got, flat)
                return got
            if flat is None:
                return await self.channel.recv_array(src, spec, 0)
            await self.channel.recv(src, spec, 0, flat.nbytes, ring.copy_into(flat, 0))
            return flat

        with line.lock:
            return line.track(self.submit_in_order(("recv", src), recv))

    def recv_now(self, flat: np.ndarray | None, src: int, begin: Begin) -> np.ndarray | None:
        """``start_recv`` and wait, on the calling thread, when no receive from ``src`` is queued on the loop:
        the thread reads the frame from the parked lane (or, with TLS, the inbox) itself, so a blocking
        receive wakes one thread when its message comes, and none when it came first. None, with ``begin``
        not called, where it cannot (nothing came from ``src`` yet, or receives are queued)."""
        rank = self.channel.ranks[src]
        take: Callable[[float], Any] | None
        if self.plane.is_direct(self.key):
            lane = self.plane.direct.get(rank, self.key)
            take = lane.next_item if lane is not None else None
        else:
            inbox = self.plane.existing_inbox(rank, self.key)
            take = inbox.get_blocking if inbox is not None else None
        if take is None:
            return None  # nothing came from there yet: the loop waits for the lane or makes the inbox
        line = _line_of(self._recv_lines, src)
        with line.lock:
            if line.pending:
                return None
            spec = begin(line.next_seq())
            got = self._read(take, flat, src, spec)
            if self.plane.is_direct(self.key):
                self._remember(line, src, spec, got, flat)
            return got

    def _remember(
        self, line: _Line, src: int, spec: OpSpec, got: np.ndarray, flat: np.ndarray | None
    ) -> None:
        """After a small message came whole on a parked lane: its header is the template of the next ones."""
        if got.nbytes <= INLINE_BYTES:
            if flat is None:  # received in the sender's dtype and shape: later ones are expected so
                spec = dataclasses.replace(spec, dtype=dtype_name(got.dtype), shape=got.shape)
            line.remember(got.dtype, self.channel.template(src, spec, got.nbytes, incoming=True))

    def _read(
        self,
        take: Callable[[float], Any],
        flat: np.ndarray | None,
        src: int,
        spec: OpSpec,
        first: Any = None,
    ) -> np.ndarray:
        """A receive on this thread (see ``GrpcChannel.recv_blocking``), bounded by the group's timeout."""
        try:
            return self.channel.recv_blocking(take, src, spec, flat, self.timeout_s, self.fail_soon, first)
        except TimeoutError:
            raise self._timed_out() from None

    def _timed_out(self) -> PlaneError:
        """A receive on a caller's thread ran out of time: fail the key everywhere (from the loop)."""
        exc = self._expired()
        self.loop.call_soon(self.plane.fail_key, self.key, exc)
        return exc

    def fail_soon(self, exc: PlaneError) -> None:
        """Fail the key with ``exc`` here and on the other members, from a thread other than the loop's."""
        self.loop.call_soon(self.channel.fail, exc)


def _write(out: np.ndarray, payload: bytes | memoryview) -> None:
    """Copy a received payload into ``out`` (C-contiguous, its size)."""
    if payload:
        try:
            memoryview(out).cast("B")[:] = payload  # type: ignore[arg-type]
        except (TypeError, ValueError):  # a dtype the buffer protocol cannot describe (bfloat16)
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(payload, np.uint8)


def _line_of(lines: dict[int, _Line], peer: int) -> _Line:
    """``peer``'s line, made on first use (not a new lock per call, as ``setdefault`` alone would)."""
    return lines.get(peer) or lines.setdefault(peer, _Line())


def _cancelled(out: concurrent.futures.Future[Any], task: asyncio.Future[None]) -> None:
    if task.cancelled() and not out.done():
        out.set_exception(PlaneClosed("the plane was shut down while the op was pending"))
