"""Host streams: a host agent's barrier arrivals, unique-id sets and waiting gets on one stream it holds.

Each call is one message in and its answer one message out (``HostCall`` / ``HostAnswer``, matched by call id),
done by the same state calls as the unary ``BarrierHost``, ``KVSet`` and waiting ``KVGet``. A release costs the
coordinator one stream write per host instead of the answer of a unary call held open per host (and an arrival
one stream read instead of a call).

Calls belong to the agent's session, not to one stream: when a stream breaks, the session keeps its calls
waiting and their answers for ``SESSION_GRACE_S``; a stream opened again with the same session gets the answers
(the agent sends its unanswered calls again, flagged ``resent``: one that arrived before is not done twice).
Past the grace, the session's calls are withdrawn, as a unary call's are when its caller goes away.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from paramplane.coordinator.hosts import Blocked, Blocking, barrier_arrivals, barrier_response, call_error
from paramplane.coordinator.model import ErrorKind, StateError
from paramplane.coordinator.state import CoordinatorState
from paramplane.protos import coordinator_pb2 as pb

log = logging.getLogger("paramplane.coordinator")

SESSION_GRACE_S = 10.0
"""How long a session whose stream ended keeps its waiting calls and their answers for a new stream."""
KEPT_ANSWERS = 1024
"""Answers a session keeps after writing them, for a call the agent sends again after a broken stream."""
KEPT_BYTES = 16 * 1024 * 1024
"""At most this many bytes of them (a waiting get's value may be large)."""

Block = Callable[[Callable[[int], None], float], Awaitable[object]]
Sync = Callable[[Callable[[], Any]], Awaitable[Any]]


class Session:
    """One agent's calls, across the streams it opens."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.context: Any = None  # the stream answers go to (None: none now)
        self.lock = asyncio.Lock()  # one write at a time on a stream
        self.seen = 0  # the highest call id read
        self.running: dict[int, asyncio.Task[None]] = {}
        self.unsent: dict[int, pb.HostAnswer] = {}
        self.sent: collections.OrderedDict[int, pb.HostAnswer] = collections.OrderedDict()
        self.sent_bytes = 0
        self.expiry: asyncio.TimerHandle | None = None


class HostStreams:
    """The coordinator's side of every agent's ``HostCalls`` stream."""

    def __init__(
        self,
        state: CoordinatorState,
        blocking: Blocking,
        block: Block,
        sync: Sync,
        num_calls: collections.Counter[str],
    ) -> None:
        self._state, self._blocking, self._block, self._sync = state, blocking, block, sync
        self._num_calls = num_calls
        self._sessions: dict[str, Session] = {}
        self._drains: set[asyncio.Task[None]] = set()

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)

    async def serve(self, calls: AsyncIterator[pb.HostCall], context: Any, lane_port: int = 0) -> None:
        """One gRPC stream: read calls until the agent closes it or goes away; answers are written as they
        come. ``lane_port`` is offered in the acknowledgement."""
        session: Session | None = None
        try:
            async for call in calls:
                if session is None:
                    if not call.session:
                        await context.abort(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            "a host stream's first message names its session",
                        )
                    session = self._attach(call.session, context)
                    async with session.lock:
                        await context.write(pb.HostAnswer(lane_port=lane_port))  # the acknowledgement: id 0
                    if session.unsent:
                        self._spawn(self._drain(session))
                elif session.context is not context:
                    return  # the agent opened a newer stream for the session: that one carries its calls
                if call.call_id:
                    self._take(session, call)
        finally:
            if session is not None:
                self.detach(session, context)

    def open_lane(self, name: str, context: Any) -> Session:
        """The session ``name`` on a host lane (``host_lane.py``), acknowledged at once: ``context.send``
        writes without waiting, ``context.write`` is awaited by the session's answers."""
        self._num_calls["HostLane"] += 1
        session = self._attach(name, context)
        context.send(pb.HostAnswer())
        if session.unsent:
            self._spawn(self._drain(session))
        return session

    def take(self, session: Session, context: Any, call: pb.HostCall) -> bool:
        """Take a call read on ``context``; False when a newer stream of the agent carries the session."""
        if session.context is not context:
            return False
        if call.call_id:
            self._num_calls["HostLane.calls"] += 1
            self._take(session, call)
        return True

    def detach(self, session: Session, context: Any) -> None:
        """``context`` ended: its session's calls wait ``SESSION_GRACE_S`` for the agent's next stream."""
        if session.context is context:
            session.context = None
            session.expiry = asyncio.get_running_loop().call_later(SESSION_GRACE_S, self._expire, session)

    def _attach(self, name: str, context: Any) -> Session:
        session = self._sessions.get(name)
        if session is None:
            session = self._sessions[name] = Session(name)
        if session.expiry is not None:
            session.expiry.cancel()
            session.expiry = None
        session.context = context
        return session

    def _expire(self, session: Session) -> None:
        if session.context is not None or self._sessions.get(session.name) is not session:
            return
        del self._sessions[session.name]
        for task in session.running.values():
            task.cancel()  # withdraws the calls' waiters from the state

    def _take(self, session: Session, call: pb.HostCall) -> None:
        call_id = call.call_id
        if call_id <= session.seen:
            if not call.resent:
                answer = pb.HostAnswer(
                    call_id=call_id,
                    error=call_error(
                        StateError(ErrorKind.INVALID_ARGUMENT, f"call id {call_id} was used already")
                    ),
                )
            elif call_id in session.running:
                return  # its answer is on its way
            else:
                answer = session.sent.get(call_id) or session.unsent.get(call_id) or _lost(call_id)
            session.unsent[call_id] = answer
            self._spawn(self._drain(session))
            return
        session.seen = call_id
        kind = call.WhichOneof("call") or "none"
        self._num_calls[f"HostCalls.{kind}"] += 1
        if kind == "barrier":
            try:
                blocked, work = self._barrier(session, call)
            except Exception as e:  # a bug: the agent still gets an answer, not a wait until its deadline
                log.exception("host call %d failed", call_id)
                session.unsent[call_id] = _internal(call_id, e)
                self._spawn(self._drain(session))
                return
            task = asyncio.ensure_future(self._run(session, call, work))
            task.add_done_callback(lambda _: self._blocking.leave_many(blocked))  # even if it never ran
        else:
            task = asyncio.ensure_future(self._run(session, call, self._answer(call)))
        session.running[call_id] = task

    def _barrier(self, session: Session, call: pb.HostCall) -> tuple[Blocked, Awaitable[pb.HostAnswer]]:
        """The host's arrivals registered now, as the call is read: the last host's arrival releases everyone
        before any task runs, and each host's answer is written as its waiters settle (``_answer_now``)."""

        def now(outcomes: list[object]) -> None:
            answer = pb.HostAnswer(call_id=call.call_id, barrier=barrier_response(outcomes))
            self._answer_now(session, answer)

        request = call.barrier
        blocked = self._blocking.enter_many(
            barrier_arrivals(self._state, request), request.timeout_s, on_done=now
        )

        async def answer() -> pb.HostAnswer:
            outcomes = await self._blocking.wait_many(blocked)
            return pb.HostAnswer(call_id=call.call_id, barrier=barrier_response(outcomes))

        return blocked, answer()

    async def _run(self, session: Session, call: pb.HostCall, work: Awaitable[pb.HostAnswer]) -> None:
        try:
            answer = await work
        except StateError as e:
            answer = pb.HostAnswer(call_id=call.call_id, error=call_error(e))
        except Exception as e:  # a bug: the agent still gets an answer, not a wait until its deadline
            log.exception("host call %d failed", call.call_id)
            answer = _internal(call.call_id, e)
        finally:
            session.running.pop(call.call_id, None)
        if call.call_id in session.sent:
            return  # written as it was settled (``_answer_now``)
        session.unsent[call.call_id] = answer
        await self._drain(session)

    async def _answer(self, call: pb.HostCall) -> pb.HostAnswer:
        """A set's or a waiting get's answer."""
        state, kind = self._state, call.WhichOneof("call")
        if kind == "kv_set":
            kv = call.kv_set
            await self._sync(lambda: state.kv_set(kv.epoch, kv.key, kv.value))
            return pb.HostAnswer(call_id=call.call_id)
        if kind == "kv_get":
            get = call.kv_get

            def register(waiter: int) -> None:
                state.kv_wait(get.epoch, get.key, get.timeout_s, waiter, time.monotonic())

            value = await self._block(register, get.timeout_s)
            assert isinstance(value, bytes)
            return pb.HostAnswer(call_id=call.call_id, value=pb.KVGetResponse(found=True, value=value))
        raise StateError(ErrorKind.INVALID_ARGUMENT, f"host call {call.call_id} carries no call")

    async def _drain(self, session: Session) -> None:
        """Write the session's unsent answers to its stream (those a broken write leaves wait for the next)."""
        async with session.lock:
            while session.unsent and (context := session.context) is not None:
                call_id, answer = next(iter(session.unsent.items()))
                try:
                    await context.write(answer)
                except Exception:  # the stream broke: the answer waits for the session's next stream
                    return
                _written(session, call_id, answer)

    def _answer_now(self, session: Session, answer: pb.HostAnswer) -> None:
        """Write ``answer`` at once where the session's stream writes without waiting (a host lane): a barrier's
        release then answers every host in one pass, as its waiters are settled, instead of in one task's turn
        per host, each delayed by the agents the answers before it woke (on a busy machine they take the
        coordinator's core). Elsewhere, or behind a write in progress, ``_run`` writes it."""
        send = getattr(session.context, "send", None)
        if send is None or session.lock.locked():
            return
        session.running.pop(answer.call_id, None)  # a resend of the call is answered from what was written
        session.unsent[answer.call_id] = answer
        while session.unsent:
            call_id, unsent = next(iter(session.unsent.items()))
            try:
                send(unsent)
            except Exception:  # the lane broke: the answers wait for the session's next stream
                return
            _written(session, call_id, unsent)


def _written(session: Session, call_id: int, answer: pb.HostAnswer) -> None:
    """``answer`` went out: kept a while for the agent's resends (within ``KEPT_ANSWERS`` and ``KEPT_BYTES``)."""
    del session.unsent[call_id]
    if (again := session.sent.pop(call_id, None)) is not None:  # an answer sent a second time
        session.sent_bytes -= again.ByteSize()
    session.sent[call_id] = answer
    session.sent_bytes += answer.ByteSize()
    while len(session.sent) > KEPT_ANSWERS or session.sent_bytes > KEPT_BYTES:
        session.sent_bytes -= session.sent.popitem(last=False)[1].ByteSize()


def _internal(call_id: int, error: Exception) -> pb.HostAnswer:
    return pb.HostAnswer(call_id=call_id, error=pb.CallError(code="INTERNAL", details=repr(error)))


def _lost(call_id: int) -> pb.HostAnswer:
    error = StateError(
        ErrorKind.UNAVAILABLE,
        f"host call {call_id}: its answer was lost with a broken stream and is no longer kept",
    )
    return pb.HostAnswer(call_id=call_id, error=call_error(error))
