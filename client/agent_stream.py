"""The host agent's side of its ``HostCalls`` stream (``coordinator/host_stream.py``).

The agent's barrier arrivals, unique-id sets and waiting gets go to the coordinator as messages on one stream
it holds, each answered by a message with its call id: no unary call is held open until a release. The stream
opens at the agent's first join (or first call); when it breaks with calls unanswered, it opens again (same
session) and sends those calls again, for ``RECONNECT_S``; then they fail with the stream's error. Every call
also has its own deadline.
A coordinator without ``HostCalls`` (UNIMPLEMENTED) makes ``supported`` false: the agent's unary calls then.
When the stream's acknowledgement offers a host lane (``coordinator/host_lane.py``), the session moves to it:
the same messages on plain TCP, each answer handed to its call as it is read; a lane out of reach leaves the
calls on the gRPC stream.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from paramplane.agent_relay import Relayed
from paramplane.node.coord_client import MAX_MESSAGE_BYTES, CoordinatorClient
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos.host_lane import FrameProtocol, LaneClosed, decode
from paramplane.protos.net import host_port, within

log = logging.getLogger("paramplane.agent")

LANE_CONNECT_S = 2.0
"""How long the agent tries to open the coordinator's host lane (and have its session taken) before it keeps
its host calls on gRPC."""
RECONNECT_S = 5.0
"""How long a broken stream with unanswered calls is opened again before those calls fail."""
_BACKOFF_S = (0.05, 1.0)


class Unsupported(Exception):
    """The coordinator has no ``HostCalls`` (an older one): make the unary call instead."""


@dataclass
class PendingCall:
    """A call on the host stream, until it is answered (``HostCallStream.submit`` / ``answer``)."""

    message: pb.HostCall
    fut: asyncio.Future[pb.HostAnswer]
    on_answer: Callable[[pb.HostAnswer], None] | None = None
    deadline: asyncio.TimerHandle | None = None
    sent_on: Any = None  # the stream it was last written on


class HostCallStream:
    """One agent's ``HostCalls`` stream to the coordinator (on the agent's loop)."""

    def __init__(self, upstream: CoordinatorClient) -> None:
        self._up = upstream
        self._session = secrets.token_hex(16)
        self._last_id = 0
        self._pending: dict[int, PendingCall] = {}
        self._stream: grpc.aio.StreamStreamCall | None = None  # open and attached
        self._lock = asyncio.Lock()  # one write at a time, in call-id order
        self._runner: asyncio.Task[None] | None = None
        self.supported = True
        """False once the coordinator answered UNIMPLEMENTED."""
        self._open = asyncio.Event()  # the coordinator took the session on the current stream
        self._use_lane = True  # until the coordinator's host lane turned out out of reach
        self._sends: set[asyncio.Future[None]] = set()

    async def call(
        self,
        message: pb.HostCall,
        timeout_s: float,
        on_answer: Callable[[pb.HostAnswer], None] | None = None,
    ) -> pb.HostAnswer:
        """``message``'s answer; raises ``Relayed`` (no answer within ``timeout_s``, or the stream failed for
        good) or ``Unsupported``. ``on_answer`` gets the answer as soon as it is read, before this call resumes
        (a release reaches the waiting ranks one turn of the event loop sooner)."""
        return await self.answer(self.submit(message, timeout_s, on_answer))

    def submit(
        self,
        message: pb.HostCall,
        timeout_s: float,
        on_answer: Callable[[pb.HostAnswer], None] | None = None,
    ) -> PendingCall:
        """``call`` in two halves: this one sends ``message`` before it returns when the session is on a host
        lane (a write that does not wait), else has it sent; ``answer`` waits for its answer. Raises
        ``Unsupported``."""
        if not self.supported:
            raise Unsupported
        self._last_id += 1
        message.call_id = self._last_id
        loop = asyncio.get_running_loop()
        entry = PendingCall(message, loop.create_future(), on_answer)
        self._pending[message.call_id] = entry
        # The deadline fails the call's own future (not ``wait_for``: its extra future costs the answer one more
        # turn of the event loop before the call resumes, on the release path of every barrier).
        entry.deadline = loop.call_later(timeout_s, _expire, entry.fut, message.call_id, timeout_s)
        stream = self._stream
        if self._runner is None or self._runner.done():
            self.open()
        elif isinstance(stream, _Lane) and not self._lock.locked():
            try:
                stream.conn.write(message)
                entry.sent_on = stream
            except ConnectionResetError:
                pass  # broken: the runner sends it again on the next stream
        else:
            self._sends.add(sending := asyncio.ensure_future(self._send(entry)))
            sending.add_done_callback(self._sends.discard)
        return entry

    async def answer(self, entry: PendingCall) -> pb.HostAnswer:
        """The answer of a call ``submit`` made."""
        try:
            return await entry.fut
        finally:
            if entry.deadline is not None:
                entry.deadline.cancel()
            del self._pending[entry.message.call_id]

    def open(self) -> None:
        """Open the stream now (if not open): the agent does at its first join, so that its ranks' first calls
        do not wait for the stream. Without calls waiting, a broken stream is opened again at the next call."""
        if self.supported and (self._runner is None or self._runner.done()):
            self._runner = asyncio.ensure_future(self._run())

    async def wait_open(self) -> None:
        """Until the stream is open (or the unary calls are to be used)."""
        if self.supported:
            await self._open.wait()

    async def _send(self, entry: PendingCall) -> None:
        async with self._lock:
            stream = self._stream
            if stream is None or entry.sent_on is stream or entry.fut.done():
                return  # the runner sends it when the stream (re)opens
            try:
                await stream.write(entry.message)
                entry.sent_on = stream
            except Exception:  # broken: the runner sends it again on the next stream
                pass

    async def _run(self) -> None:
        """Open the stream, send the unanswered calls, hand answers to their calls; again after a break while
        calls wait (for ``RECONNECT_S``)."""
        backoff, give_up = _BACKOFF_S[0], None
        while True:
            stream: Any = self._up.host_calls()
            error: Relayed
            try:
                # The session first, alone until the coordinator acknowledges it (an answer with call id 0): a
                # coordinator without the stream refuses it before any call is written.
                await stream.write(pb.HostCall(session=self._session))
                while (answer := await stream.read()) is not grpc.aio.EOF and self._answered(answer):
                    pass
                if answer is not grpc.aio.EOF and answer.lane_port and self._use_lane:
                    lane = await self._open_lane(answer.lane_port)
                    if lane is not None:  # the session moves to the lane (acknowledged there too)
                        stream.cancel()
                        stream = lane
                if answer is not grpc.aio.EOF:
                    async with self._lock:
                        for call_id in sorted(self._pending):
                            entry = self._pending[call_id]
                            entry.message.resent = entry.sent_on is not None
                            await stream.write(entry.message)
                            entry.sent_on = stream
                        self._stream = stream
                        self._open.set()
                    backoff, give_up = _BACKOFF_S[0], None
                    while (answer := await stream.read()) is not grpc.aio.EOF:
                        self._answered(answer)
                error = Relayed(grpc.StatusCode.UNAVAILABLE, "the coordinator ended the host stream")
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # the agent stops
                error = Relayed(grpc.StatusCode.CANCELLED, "the host stream was cancelled")
            except (OSError, LaneClosed) as e:  # the lane broke
                error = Relayed(grpc.StatusCode.UNAVAILABLE, f"the host lane to the coordinator broke: {e}")
            except grpc.aio.AioRpcError as e:
                error = Relayed.of(e)
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    # Refused before it took the session: a coordinator without the stream (UNIMPLEMENTED, or
                    # INTERNAL when grpc races the refusal with the write); the unary calls tell any other error.
                    self.supported = stream is self._stream
                    self._fail(error if self.supported else Unsupported())
                    self._open.set()  # nothing more to wait for: the calls fail or go unary
                    return
            finally:
                stream.cancel()
                if self._stream is stream:
                    self._stream = None
                    self._open.clear()
            if not self._pending:
                return  # idle: the next call opens a stream
            give_up = give_up or time.monotonic() + RECONNECT_S
            if time.monotonic() >= give_up:
                self._fail(error)
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_S[1])

    async def _open_lane(self, port: int) -> _Lane | None:
        """The session on a host lane at ``port`` (acknowledged), or None: then the gRPC stream it came on
        carries the calls, and later streams do too (a lane that cannot be reached is not tried again)."""
        where = self._up.lane_hello(self._session)
        if where is None:
            self._use_lane = False
            return None
        host, hello = where
        lane = _Lane()
        try:
            await within(
                asyncio.get_running_loop().create_connection(lambda: lane.conn, host, port), LANE_CONNECT_S
            )
        except (OSError, TimeoutError) as e:
            log.warning(
                "the coordinator's host lane %s is out of reach (%s): host calls stay on gRPC",
                host_port(host, port),
                e or "no answer in time",
            )
            self._use_lane = False
            return None
        try:
            await lane.write(hello)
            ack = await within(lane.read(), LANE_CONNECT_S)
        except (OSError, LaneClosed, TimeoutError):
            ack = grpc.aio.EOF
        if ack is grpc.aio.EOF or ack.call_id != 0:
            log.warning(
                "the coordinator's host lane %s did not take the session: host calls stay on gRPC",
                host_port(host, port),
            )
            lane.cancel()
            self._use_lane = False
            return None
        lane.on_answer = self._answered  # as they are read: one turn of the event loop less per answer
        return lane

    def _answered(self, answer: object) -> bool:
        """Hand ``answer`` to its call; False for the session's acknowledgement (call id 0)."""
        assert isinstance(answer, pb.HostAnswer)
        waiting = self._pending.get(answer.call_id)
        if waiting is not None and not waiting.fut.done():
            waiting.fut.set_result(answer)
            if waiting.on_answer is not None:
                waiting.on_answer(answer)
        return answer.call_id != 0

    def _fail(self, error: Exception) -> None:
        for entry in self._pending.values():
            if not entry.fut.done():
                entry.fut.set_exception(error)

    async def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)


class _Lane:
    """A host lane connection with what ``_run`` uses of a gRPC stream: ``write``, ``read`` (EOF once it has
    closed), ``cancel``. Once ``on_answer`` is set, answers go to it as they are read, not through ``read``."""

    def __init__(self) -> None:
        self.conn = FrameProtocol(MAX_MESSAGE_BYTES, self._frame, self._closed)
        self.on_answer: Callable[[pb.HostAnswer], object] | None = None
        self._answers: collections.deque[pb.HostAnswer] = collections.deque()
        self._ready: asyncio.Future[None] | None = None
        self._closed_with: BaseException | None = None
        self._is_closed = False

    def _frame(self, data: bytes) -> None:
        answer = decode(pb.HostAnswer(), data)
        if self.on_answer is not None:
            self.on_answer(answer)
        else:
            self._answers.append(answer)
            self._wake()

    def _closed(self, error: BaseException | None) -> None:
        self._is_closed, self._closed_with = True, error
        self._wake()

    def _wake(self) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    async def write(self, message: Message) -> None:
        self.conn.write(message)

    async def read(self) -> Any:
        while not self._answers:
            if self._is_closed:
                if isinstance(self._closed_with, LaneClosed):
                    raise self._closed_with
                return grpc.aio.EOF
            self._ready = asyncio.get_running_loop().create_future()
            await self._ready
        return self._answers.popleft()

    def cancel(self) -> None:
        self.conn.close()


def _expire(fut: asyncio.Future[pb.HostAnswer], call_id: int, timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(
            Relayed(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the coordinator did not answer host call {call_id} within {timeout_s:.1f} s",
            )
        )


async def upstream_kv(
    stream: HostCallStream | None, up: CoordinatorClient, method: str, request: Any, timeout_s: float
) -> Any:
    """A rank's ``KVSet`` or waiting ``KVGet``: on the host stream when the coordinator has one, else relayed
    as a unary call. Answers the call's response; raises ``Relayed`` or the unary call's ``AioRpcError``."""
    if stream is not None and stream.supported:
        field = "kv_set" if method == "KVSet" else "kv_get"
        try:
            answer = await stream.call(pb.HostCall(**{field: request}), timeout_s)
        except Unsupported:
            pass
        else:
            if answer.HasField("error"):
                raise Relayed.of_call(answer.error)
            return answer.value if method == "KVGet" else pb.KVSetResponse()
    return await up.relay(method, request, timeout_s=timeout_s)
