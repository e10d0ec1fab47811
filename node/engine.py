"""One process group's engine: ordering, failure state, deadlines, and running each op on its transport.

Every collective is checked before any communication (in the client), given the next
sequence number by the group's actor and run on the transport the factory picks from its
table (``node/transports/factory.py``). The engine stages device arrays through host
memory for host transports and applies ``mean`` once, after any transport. After a failure
the group stays failed: later ops raise the same error at once.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from paramplane.node.actor import OpActor
from paramplane.node.arrays import array_module, dtype_name, is_cupy, is_device, to_host
from paramplane.node.counters import RankCounters
from paramplane.node.errors import DeviceCommError, PeerLost, PlaneError
from paramplane.node.spec import OpSpec, check_reduce_op, split_bounds
from paramplane.node.transports.base import Bounds, Comm, Transport
from paramplane.node.transports.factory import TransportContext, TransportFactory

T = TypeVar("T")


class Tracer(Protocol):
    def record(
        self, name: str, group: str, seq: int, nbytes: int, start: float, end: float, transport: str
    ) -> None: ...
    def close(self) -> None: ...


class PlaneContext(TransportContext, Protocol):
    """What a group needs from its node runtime."""

    tracer: Tracer | None
    counters: RankCounters

    def new_group(self, ranks: Sequence[int], timeout_s: float | None = None) -> GroupEngine: ...

    def abort_world(self, exc: PlaneError) -> None: ...

    def cause_of_peer_lost(self, exc: PeerLost) -> PlaneError: ...


def check_array(x: Any, what: str = "x", *, writable: bool = True) -> None:
    """ValueError for anything the plane cannot move in place."""
    if not (isinstance(x, np.ndarray) or is_device(x)):
        raise ValueError(f"{what} must be a numpy or cupy array, got {type(x).__name__}")
    dtype_name(x.dtype)
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{what} is not C-contiguous: pass np.ascontiguousarray({what}) (collectives work in place)"
        )
    # cupy arrays are always writable and their flags have no `writeable`.
    if writable and isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{what} is read-only: collectives write their result into it; pass a writable copy")


class _Staged:
    """``x`` as the comm takes it: itself (host comm and numpy, or a device comm) or a host copy."""

    def __init__(self, x: Any, comm: Comm, *, copy_in: bool = True) -> None:
        self.x = x
        self.staged = is_device(x) and not comm.device
        if self.staged:
            self.arr = to_host(x) if copy_in else np.empty(x.shape, x.dtype)
        else:
            self.arr = x
        self.flat = self.arr.reshape(-1)

    def write_back(self) -> None:
        if self.staged:
            self.x[...] = array_module(self.x).asarray(self.arr)


def _settled(result: Any = None, exc: BaseException | None = None) -> concurrent.futures.Future[Any]:
    fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)
    return fut


SENT = _settled()  # every send that left at once shares this (done futures never change)


class GroupEngine:
    """The collectives of one group of global ``ranks`` as seen by rank ``ctx.rank``."""

    def __init__(self, ctx: PlaneContext, name: str, ranks: Sequence[int], timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"group timeout must be positive, got {timeout_s}")
        self.ctx = ctx
        self.name = name
        self.ranks = list(ranks)
        self.rank = self.ranks.index(ctx.rank)
        self.size = len(self.ranks)
        self.timeout_s = timeout_s
        self.actor = OpActor(name)
        # Finishes asynchronous receives of device arrays (the copy from host) on the caller's stream.
        self.recv_actor = OpActor(f"{name}/recv")
        self.failure: PlaneError | None = None
        self.transports = TransportFactory(ctx, name, self.ranks, timeout_s)

    # -- ordering, failure, deadlines --------------------------------------------------------------
    def progress(self) -> tuple[int, int]:
        return self.actor.issued, self.actor.completed

    def transport_for(self, x: Any, op: str) -> Transport:
        return self.transports.choose(x, op)

    def deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def check(self) -> None:
        """Raise the group's failure, if any (the check every op makes first)."""
        if self.failure is not None:
            raise self.failure
        if self.ctx.aborted.is_set():
            self.failure = self.ctx.abort_error()
            raise self.failure

    def run(
        self,
        name: str,
        body: Callable[[int], T],
        *,
        nbytes: int,
        transport: str,
        async_op: bool,
    ) -> concurrent.futures.Future[T]:
        """Issue ``body(seq)`` in order; failures are recorded so the group stays failed."""

        def op(seq: int) -> T:
            self.check()
            start = time.monotonic()
            try:
                result = body(seq)
                self.ctx.counters.count_op(self._traced(transport), nbytes)
                return result
            except PlaneError as exc:
                cause = self._failed(exc)
                if cause is not exc:
                    raise cause from exc
                raise
            finally:
                if self.ctx.tracer is not None:
                    self.ctx.tracer.record(
                        name, self.name, seq, nbytes, start, time.monotonic(), self._traced(transport)
                    )

        return self.actor.submit(op, async_op=async_op)

    def _traced(self, transport: str) -> str:
        """A trace's name for ``transport``: the ``grpc`` transport's frames ride lanes or gRPC streams."""
        return self.ctx.plane.frames_ride if transport == "grpc" else transport

    def abort_p2p(self, exc: PlaneError) -> None:
        """Fail the group's point-to-point messages with ``exc`` here and on its other members (from any
        thread but the loop's): their pending and later receives from this group raise it."""
        self.transports.p2p.fail_soon(exc)

    def _failed(self, exc: PlaneError) -> PlaneError:
        """Record an op's failure as the group's (the first one stays) and return what to raise. Blocking (a
        lost peer's cause is asked of the coordinator): never on the loop."""
        cause = self.ctx.cause_of_peer_lost(exc) if isinstance(exc, PeerLost) else exc
        self.failure = self.failure or cause
        self.transports.abort()
        if isinstance(exc, DeviceCommError):  # peers may wait inside NCCL kernels: tell every rank
            self.ctx.abort_world(exc)
        return cause

    def p2p(
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
            return _settled(exc=exc)
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
                    return _settled(exc=self._failed(exc))
                if got is not None:
                    trace(got)
                    return _settled(result if x is not None else got)
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
    def send_small(self, x: np.ndarray, peer: int) -> concurrent.futures.Future[Any] | None:
        """``p2p("send", x, peer)`` for a C-contiguous ``x`` of a dtype and shape sent to ``peer`` before, with
        nothing queued there: sent from this thread (``SENT``, or the future of its rest); None where the
        short path does not apply (``p2p`` then)."""
        if self.failure is not None or self.ctx.aborted.is_set():
            return None
        tracer = self.ctx.tracer
        start = time.monotonic() if tracer is not None else 0.0
        sent = self.transports.p2p.send_small(x, peer)
        if sent is None:
            return None
        seq, rest = sent

        def trace(moved: Any) -> None:
            self.ctx.counters.count_op(self._traced("grpc"), int(moved.nbytes))
            if tracer is not None:
                tracer.record(
                    "send", self.name, seq, int(moved.nbytes), start, time.monotonic(), self._traced("grpc")
                )

        if rest is None:
            trace(x)
            return SENT
        return self._settle(rest, trace, x, None)

    def recv_small(self, x: np.ndarray | None, peer: int) -> np.ndarray | None:
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

    def close(self) -> None:
        self.actor.close()
        self.recv_actor.close()
        self.transports.close()

    # -- running ops (inside ``run``'s body: in order, one at a time) -------------------------------
    def _comm(self, x: Any, op: str) -> Comm:
        return self.transports.get(self.transports.choose(x, op), x)

    def _mean(self, x: Any) -> None:
        if self.size > 1:
            if is_cupy(x):
                x /= self.size
            else:
                np.true_divide(x, self.size, out=x, casting="unsafe")

    def _divides_first(self, x: Any, op: str) -> bool:
        """A float16 ``mean`` divides each rank's values before the sum (as NCCL's ``ncclAvg`` does): a sum of
        float16 values overflows past 65504 where their mean need not (gradients averaged over ranks). Wider
        types sum first, which keeps their smallest values exact."""
        return op == "mean" and self.size > 1 and x.dtype == np.float16

    def all_reduce(self, spec: OpSpec, x: Any, op: str) -> None:
        comm = self._comm(x, "all_reduce")
        s = _Staged(x, comm)
        first = self._divides_first(x, op)
        if first:
            self._mean(s.flat)  # in place: the op overwrites x anyway
        comm.all_reduce(spec, s.flat, "sum" if op == "mean" else op, self.deadline())
        s.write_back()
        if op == "mean" and not first:
            self._mean(x)

    def broadcast(self, spec: OpSpec, x: Any, root: int) -> None:
        comm = self._comm(x, "broadcast")
        s = _Staged(x, comm, copy_in=self.rank == root)
        comm.broadcast(spec, s.flat, root, self.deadline())
        s.write_back()

    def all_gather(self, spec: OpSpec, x: Any, out: Any) -> None:
        comm = self._comm(x, "all_gather")
        piece, result = _Staged(x, comm), _Staged(out, comm, copy_in=False)
        comm.all_gather(spec, piece.flat, result.flat, self.deadline())
        result.write_back()

    def reduce_scatter(self, spec: OpSpec, x: Any, bounds: Bounds, op: str, out: Any) -> None:
        comm = self._comm(x, "reduce_scatter")
        flat, result = _Staged(x, comm), _Staged(out, comm, copy_in=False)
        first = self._divides_first(x, op)
        source = flat.flat
        if first:
            source = source / self.size  # a copy: the caller's input stays as it was
        comm.reduce_scatter(spec, source, bounds, "sum" if op == "mean" else op, result.flat, self.deadline())
        result.write_back()
        if op == "mean" and not first:
            self._mean(out)

    def gather(self, spec: OpSpec, x: Any, root: int, out: Any | None) -> None:
        comm = self._comm(x, "gather")
        piece = _Staged(x, comm)
        result = _Staged(out, comm, copy_in=False) if out is not None else None
        comm.gather(spec, piece.flat, root, result.flat if result is not None else None, self.deadline())
        if result is not None:
            result.write_back()

    def scatter(self, spec: OpSpec, pieces: Sequence[Any] | None, root: int, out: Any) -> None:
        comm = self._comm(out, "scatter")
        flats = [_Staged(p, comm).flat for p in pieces] if pieces is not None else None
        result = _Staged(out, comm, copy_in=False)
        comm.scatter(spec, flats, root, result.flat, self.deadline())
        result.write_back()

    def barrier(self, spec: OpSpec) -> None:
        self._comm(None, "barrier").barrier(spec, self.deadline())

    # -- argument helpers ------------------------------------------------------------------------
    def spec(self, seq: int, op: str, x: Any, arg: str = "") -> OpSpec:
        return OpSpec(self.name, seq, op, dtype_name(x.dtype), tuple(int(d) for d in x.shape), arg)

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

    def check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"{what}={root} is not a rank of group '{self.name}' (size {self.size})")

    @staticmethod
    def check_reduce(op: str, x: Any) -> None:
        check_reduce_op(op, np.dtype(x.dtype))

    def split_rows(self, rows: int) -> list[tuple[int, int]]:
        return split_bounds(rows, self.size)
