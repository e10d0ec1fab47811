"""A group's point-to-point messages (``send`` / ``recv`` / ``recv_array``): part of ``GroupEngine``.

Messages pair up in issue order per direction, on the runtime's loop with no thread of the group in
between (a pipeline's activations are latency bound; see ``node/transports/p2p.py``): a small message of
a dtype and shape sent before leaves from the caller's thread, and a blocking receive with nothing queued
before it reads its frame on the caller's thread. Device arrays go through host memory.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from paramplane.node.arrays import array_module, device_of, dtype_name, is_cupy, to_host
from paramplane.node.checks import check_array
from paramplane.node.errors import PlaneError
from paramplane.node.spec import OpSpec


def settled(result: Any = None, exc: BaseException | None = None) -> concurrent.futures.Future[Any]:
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
    return fut


SENT = settled()  # every send that left at once shares this (done futures never change)


class PointToPointOps:
    """The point-to-point half of ``GroupEngine`` (which provides the attributes below)."""

    name: str
    rank: int
    size: int
    ctx: Any
    transports: Any
    recv_actor: Any
    failure: PlaneError | None

    def check(self) -> None:
        raise NotImplementedError

    def check_root(self, root: int, what: str) -> None:
        raise NotImplementedError

    def _failed(self, exc: PlaneError) -> PlaneError:
        raise NotImplementedError

    def _traced(self, transport: str) -> str:
        raise NotImplementedError

    def _check_peer(self, peer: int, what: str) -> None:
        self.check_root(peer, what)
        if peer == self.rank:
            raise ValueError(f"{what}={peer} is this rank itself")

    def send(self, x: Any, dst: int) -> concurrent.futures.Future[None]:
        """Send array ``x`` to group rank ``dst`` (matched by a ``recv`` there, in order): ``SENT`` when it left
        at once, else the future of its rest (a device array is copied to host first)."""
        if type(x) is np.ndarray and x.flags.c_contiguous:
            fut = self._send_small(x, dst)  # a pipeline's messages: the short path
            if fut is not None:
                return fut
        check_array(x, writable=False)
        self._check_peer(dst, "dst")
        return self._p2p("send", to_host(x), dst)

    def recv(self, x: Any, src: int, *, async_op: bool = False) -> concurrent.futures.Future[Any]:
        """Fill array ``x`` with what group rank ``src`` sends (same shape and dtype); the future's value is
        ``x``. Done on return unless ``async_op``."""
        if not async_op and type(x) is np.ndarray:
            flags = x.flags
            if flags.c_contiguous and flags.writeable and self._recv_small(x, src) is not None:
                return settled(x)
        check_array(x)
        self._check_peer(src, "src")
        if not is_cupy(x):
            return self._p2p("recv", x, src, x, blocking=not async_op)
        staged = np.empty(x.shape, x.dtype)

        def write_back(got: np.ndarray) -> Any:
            with device_of(x):  # the copy lands on x's GPU, not the current one
                x[...] = array_module(x).asarray(got)
            return x

        return self._on_device(self._p2p("recv", staged, src, staged), x, write_back, async_op)

    def recv_now(self, x: np.ndarray | None, src: int) -> np.ndarray:
        """A blocking ``recv`` into host array ``x`` (``recv_array`` of a numpy array when None) that returns the
        array itself: the short path makes no future (a pipeline's receiver thread runs this once per message,
        on cold caches, where a future's lock and condition are a good part of its cost)."""
        if x is None or (x.flags.c_contiguous and x.flags.writeable):
            got = self._recv_small(x, src)
            if got is not None:
                return got
        return (self.recv_array(src) if x is None else self.recv(x, src)).result()

    def recv_array(
        self, src: int, like: Any = None, *, async_op: bool = False
    ) -> concurrent.futures.Future[Any]:
        """The next array ``src`` sends, in its dtype and shape: a new numpy array, or a cupy array on the
        current device when ``like`` is one. Done on return unless ``async_op``."""
        if not async_op and (like is None or type(like) is np.ndarray):
            got = self._recv_small(None, src)
            if got is not None:
                return settled(got)
        self._check_peer(src, "src")
        fut = self._p2p("recv", None, src, blocking=not async_op)
        if like is None or not is_cupy(like):
            return fut
        return self._on_device(fut, like, array_module(like).asarray, async_op)

    def _on_device(
        self, fut: concurrent.futures.Future[Any], like: Any, finish: Callable[[Any], Any], async_op: bool
    ) -> concurrent.futures.Future[Any]:
        """``finish`` (the copy of the received host array to ``like``'s device) on the caller's stream: here,
        or on the group's receive actor when asynchronous."""
        if not async_op:
            return settled(finish(fut.result()))
        from paramplane.node.transports.nccl import capture_stream, on_stream

        stream = capture_stream()

        def body(_seq: int) -> Any:
            got = fut.result()
            with on_stream(like, stream):
                return finish(got)

        return self.recv_actor.submit(body, async_op=True)

    def abort_p2p(self, exc: PlaneError) -> None:
        """Fail the group's point-to-point messages with ``exc`` here and on its other members (from any
        thread but the loop's): their pending and later receives from this group raise it."""
        self.transports.p2p.fail_soon(exc)

    def _p2p(
        self, name: str, x: np.ndarray | None, peer: int, result: Any = None, *, blocking: bool = False
    ) -> concurrent.futures.Future[Any]:
        """Start a ``"send"`` of host array ``x`` to group rank ``peer``, or a ``"recv"`` from it into ``x`` (into a
        new array of the sender's dtype and shape when ``x`` is None, which is then the future's value; else
        ``result`` is).

        Messages pair up in issue order per direction, on the runtime's loop with no thread of the group in
        between (a pipeline's activations are latency bound); a ``blocking`` receive with none queued before
        it waits on the calling thread and returns a done future. A failure is recorded as the group's.
        """
        try:
            self.check()
        except PlaneError as exc:
            return settled(exc=exc)
        src, dst = (self.rank, peer) if name == "send" else (peer, self.rank)
        started: dict[str, Any] = {}

        # Called when the op's turn comes (on the loop, or here for a send that leaves at once), so message
        # numbers follow the order on the wire.
        def begin(seq: int) -> OpSpec:
            self.check()
            started.update(spec=self.p2p_spec(x, src, dst, seq), at=time.monotonic())
            return started["spec"]

        def trace(moved: Any) -> None:
            nbytes = int(moved.nbytes) if moved is not None else 0
            self.ctx.counters.count_op(self._traced("grpc"), nbytes)
            if self.ctx.tracer is not None and started:
                seq = started["spec"].seq
                self.ctx.tracer.record(
                    name, self.name, seq, nbytes, started["at"], time.monotonic(), self._traced("grpc")
                )

        p2p = self.transports.p2p
        inner: concurrent.futures.Future[Any] | None
        if name == "send":
            assert x is not None
            inner = p2p.start_send(x.reshape(-1), peer, begin)
            if inner is None:
                trace(x)
                return SENT
        else:
            flat = x.reshape(-1) if x is not None else None
            if blocking:
                try:
                    got = p2p.recv_now(flat, peer, begin)
                except PlaneError as exc:
                    trace(x)
                    return settled(exc=self._failed(exc))
                if got is not None:
                    trace(got)
                    return settled(result if x is not None else got)
            inner = p2p.start_recv(flat, peer, begin)
        return self._settle(inner, trace, x, result)

    def _settle(
        self,
        inner: concurrent.futures.Future[Any],
        trace: Callable[[Any], None],
        x: np.ndarray | None,
        result: Any,
    ) -> concurrent.futures.Future[Any]:
        """The caller's future of a point-to-point op the loop finishes: traced, its failure the group's."""
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(inner: concurrent.futures.Future[Any]) -> None:
            exc = inner.exception()
            trace(x if x is not None or exc is not None else inner.result())
            if exc is None:
                out.set_result(result if x is not None else inner.result())
            elif isinstance(exc, PlaneError):
                threading.Thread(target=lambda: out.set_exception(self._failed(exc)), daemon=True).start()
            else:
                out.set_exception(exc)

        inner.add_done_callback(done)
        return out

    # The short paths of ``p2p`` for the messages a pipeline sends each step (see node/transports/p2p.py).
    def _send_small(self, x: np.ndarray, peer: int) -> concurrent.futures.Future[Any] | None:
        """``p2p("send", x, peer)`` for a C-contiguous ``x`` of a dtype and shape sent to ``peer`` before, with
        nothing queued there: sent from this thread (``SENT``, or the future of its rest); None where the
        short path does not apply (``p2p`` then)."""
        ctx = self.ctx
        if self.failure is not None or ctx.aborted.is_set():
            return None
        tracer = ctx.tracer
        start = time.monotonic() if tracer is not None else 0.0
        sent = self.transports.p2p.send_small(x, peer)
        if sent is None:
            return None
        seq, rest = sent
        label = self._traced("grpc")
        if rest is None and tracer is None:  # the common case, with no closure made
            ctx.counters.count_op(label, x.nbytes)
            return SENT

        def trace(moved: Any) -> None:
            ctx.counters.count_op(label, int(moved.nbytes))
            if tracer is not None:
                tracer.record("send", self.name, seq, int(moved.nbytes), start, time.monotonic(), label)

        if rest is None:
            trace(x)
            return SENT
        return self._settle(rest, trace, x, None)

    def _recv_small(self, x: np.ndarray | None, peer: int) -> np.ndarray | None:
        """A blocking ``p2p("recv", x, peer)``, into a C-contiguous, writable ``x`` of a dtype and shape received
        from ``peer`` before or (``x`` None) into a new array, with nothing queued there: the array once it
        holds the message; None where the short path does not apply (``p2p`` then). A failure is the
        group's, and raised."""
        if self.failure is not None or self.ctx.aborted.is_set():
            return None
        tracer = self.ctx.tracer
        start = time.monotonic() if tracer is not None else 0.0
        try:
            got = self.transports.p2p.recv_small(x, peer, self.p2p_spec)
        except PlaneError as exc:
            raise self._failed(exc) from None
        if got is None:
            return None
        self.ctx.counters.count_op(self._traced("grpc"), int(got[1].nbytes))
        if tracer is not None:
            tracer.record(
                "recv", self.name, got[0], int(got[1].nbytes), start, time.monotonic(), self._traced("grpc")
            )
        return got[1]

    def p2p_spec(self, x: Any, src: int, dst: int, seq: int) -> OpSpec:
        """The spec of message ``seq`` from group rank ``src`` to ``dst`` (numbered per direction); ``x`` None
        for a receive that takes the sender's dtype and shape."""
        return OpSpec(
            f"{self.name}/p2p",
            seq,
            "send/recv",
            dtype_name(x.dtype) if x is not None else "any",
            tuple(x.shape) if x is not None else (),
            f"{src}->{dst}",
        )
