"""The gRPC transport: framed raw-byte streams of the peer plane, and the collectives over them.

``GrpcChannel`` sends and receives frames (a protobuf ``FrameHeader`` naming the op, then raw
chunks); the algorithms (direct exchange, ring) live in ``node/algorithms/ring.py``.
``GrpcTransport`` is the ``Comm``: it runs those algorithms on the runtime's event loop,
bounded by the op's deadline, failing the stream key on every member when the deadline passes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

import numpy as np

from paramplane.node.algorithms import ring
from paramplane.node.algorithms.ring import Sink
from paramplane.node.arrays import DTYPES
from paramplane.node.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    PeerLost,
    PlaneError,
    TransportError,
)
from paramplane.node.failures import failure_message
from paramplane.node.loop import LoopThread
from paramplane.node.peer import CHUNK_BYTES, ERROR_SUFFIX, PeerPlane
from paramplane.node.spec import OpSpec
from paramplane.node.transports.base import Bounds, Splits, Transport
from paramplane.node.transports.thread_channel import INLINE_BYTES, ThreadChannel
from paramplane.protos import peer_pb2
from paramplane.protos.net import best_effort

T = TypeVar("T")


class GrpcChannel:
    """Framed messages between one group's members on one stream key of the peer plane
    (a ``FrameChannel`` for the algorithms in ``node/algorithms/ring.py``)."""

    def __init__(
        self, plane: PeerPlane, key: str, ranks: Sequence[int], me: int, *, direct: bool = False
    ) -> None:
        self.plane = plane
        self.key = key
        self.ranks = list(ranks)
        self.me = me
        self.index = self.ranks.index(me)
        self.n = len(self.ranks)
        self.direct = direct
        plane.register_stream_key(key, frozenset(self.ranks), direct=direct)

    # -- frames ----------------------------------------------------------------------------------
    async def send(self, idx: int, spec: OpSpec, step: int, payload: np.ndarray | None) -> None:
        """Send ``payload`` (a contiguous array, or None for an empty frame) to group index ``idx``."""
        try:
            await self._send(idx, spec, step, payload)
        except PeerLost as exc:
            raise self.fail(exc) from None

    async def recv(self, idx: int, spec: OpSpec, step: int, nbytes: int, sink: Sink) -> None:
        """Receive one frame from group index ``idx``, check it against ``spec``, feed its chunks to ``sink``.

        A lost peer fails the op here and, through error frames, on every other member at once (a
        rank that never receives from the dead one would otherwise wait for the coordinator).
        """
        try:
            await self._recv(idx, spec, step, nbytes, sink)
        except PeerLost as exc:
            raise self.fail(exc) from None

    def header(
        self, idx: int, spec: OpSpec, step: int, payload: np.ndarray | None
    ) -> tuple[bytes, np.ndarray]:
        """A frame's serialized header for ``payload`` to group index ``idx`` (carrying the payload itself up
        to ``INLINE_BYTES``), and the payload's bytes."""
        data = payload.reshape(-1).view(np.uint8) if payload is not None else np.empty(0, np.uint8)
        nbytes = data.nbytes
        header = self.template(idx, spec, nbytes)
        header.seq, header.step, header.num_chunks = spec.seq, step, _num_chunks(nbytes)
        if 0 < nbytes <= INLINE_BYTES:
            header.inline_payload = data.tobytes()
        return header.SerializeToString(), data

    def template(
        self, idx: int, spec: OpSpec, nbytes: int, *, incoming: bool = False
    ) -> peer_pb2.FrameHeader:
        """The header of a message of ``spec`` and ``nbytes`` to (``incoming``: from) group index ``idx``,
        without its sequence number, step, chunk count and payload (``header`` adds them; the point-to-point
        lines keep one per dtype and shape and set only seq and payload per message)."""
        src, dst = (self.ranks[idx], self.me) if incoming else (self.me, self.ranks[idx])
        return peer_pb2.FrameHeader(
            group=spec.group,
            op=spec.op,
            dtype=spec.dtype,
            shape=spec.shape,
            src=src,
            dst=dst,
            nbytes=nbytes,
            arg=spec.arg,
        )

    async def _send(self, idx: int, spec: OpSpec, step: int, payload: np.ndarray | None) -> None:
        header, data = self.header(idx, spec, step, payload)
        num_chunks = _num_chunks(data.nbytes)
        stream = await self.plane.stream(self.ranks[idx], self.key)
        failure = self.plane.failure(self.key)
        if failure is not None:
            raise failure
        view = memoryview(data)  # type: ignore[arg-type]  # a gRPC stream copies each chunk to bytes; a TCP lane sends it as is
        chunks = (view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES] for i in range(num_chunks))
        await stream.send_frame(itertools.chain([header], chunks))

    async def recv_array(self, idx: int, spec: OpSpec, step: int) -> np.ndarray:
        """Receive one frame into a new array of the dtype and shape its header carries (``spec``'s are
        not compared); everything else is checked as ``recv`` checks it."""
        try:
            array = await self._recv(idx, spec, step, None, None)
        except PeerLost as exc:
            raise self.fail(exc) from None
        assert array is not None
        return array

    async def _recv(
        self, idx: int, spec: OpSpec, step: int, nbytes: int | None, sink: Sink | None
    ) -> np.ndarray | None:
        """With ``nbytes`` None: into a new array as the header describes it, which is returned."""
        inbox = self.plane.inbox(self.ranks[idx], self.key)
        frame = self._frame(idx, spec, step, nbytes, sink)
        next(frame)
        while True:
            item = await inbox.get()
            try:
                frame.send(item)
            except StopIteration as done:
                return done.value
            except PlaneError as exc:
                raise self.fail(exc) from None

    def recv_blocking(
        self,
        take: Callable[[float], Any],
        idx: int,
        spec: OpSpec,
        flat: np.ndarray | None,
        timeout: float,
        fail_soon: Callable[[PlaneError], None],
        first: Any = None,
    ) -> np.ndarray:
        """``recv`` (``flat`` None: ``recv_array``) on the calling thread, which reads the frame's items with
        ``take(timeout)`` (an inbox's ``get_blocking`` or a parked lane's ``next_item``), after ``first``
        when the caller took the header already; nothing else may read them meanwhile. A failure this
        receive finds is passed to ``fail_soon`` (to fail the key on the loop) and raised; TimeoutError
        after ``timeout`` seconds."""
        sink = ring.copy_into(flat, 0) if flat is not None else None
        nbytes = flat.nbytes if flat is not None else None
        deadline = time.monotonic() + timeout
        got = self.recv_frame(take, idx, spec, 0, nbytes, sink, deadline, fail_soon, first)
        if flat is not None:
            return flat
        assert got is not None
        return got

    def recv_frame(
        self,
        take: Callable[[float], Any],
        idx: int,
        spec: OpSpec,
        step: int,
        nbytes: int | None,
        sink: Sink | None,
        deadline: float,
        fail_soon: Callable[[PlaneError], None],
        first: Any = None,
    ) -> np.ndarray | None:
        """One frame from group index ``idx`` read on the calling thread with ``take`` (see ``recv_blocking``),
        checked against ``spec``, ``step`` and ``nbytes`` and fed to ``sink`` (``nbytes`` None: into a new
        array, returned); TimeoutError at ``deadline`` (``time.monotonic()``)."""
        frame = self._frame(idx, spec, step, nbytes, sink)
        next(frame)
        while True:
            try:
                item = take(deadline - time.monotonic()) if first is None else first
                first = None
            except PeerLost as exc:
                fail_soon(exc)
                raise
            try:
                frame.send(item)
            except StopIteration as done:
                value: np.ndarray | None = done.value
                return value
            except PlaneError as exc:
                fail_soon(exc)
                raise

    def _frame(
        self, idx: int, spec: OpSpec, step: int, nbytes: int | None, sink: Sink | None
    ) -> Generator[None, Any, np.ndarray | None]:
        """Checks one incoming frame's items, sent in one by one, against ``spec`` and feeds its payload to
        ``sink``; returns the new array when ``nbytes`` is None. Raises the PlaneError the key must fail
        with (the caller fails it)."""
        src = self.ranks[idx]
        header = yield
        if not isinstance(header, peer_pb2.FrameHeader):
            raise TransportError(f"stream from rank {src} lost its framing (payload where a header was due)")
        theirs = OpSpec(spec.group, header.seq, header.op, header.dtype, tuple(header.shape), header.arg)
        array = None
        if nbytes is None:
            text = spec.mismatch(
                self.me, src, dataclasses.replace(theirs, dtype=spec.dtype, shape=spec.shape)
            )
            if text is None:
                array = self._allocate(src, header)
                nbytes, sink = array.nbytes, ring.copy_into(array.reshape(-1), 0)
        else:
            text = spec.mismatch(self.me, src, theirs)
        if text is None and (header.step != step or header.nbytes != nbytes):
            text = (
                f"collective mismatch in group '{spec.group}' at op #{spec.seq} {spec.describe()}: rank {src} "
                f"sent step {header.step} with {header.nbytes} bytes where rank {self.me} expected step {step} "
                f"with {nbytes} bytes"
            )
        if text is not None:
            raise CollectiveMismatch(text)
        assert nbytes is not None and sink is not None
        if header.num_chunks == 0:
            if len(header.inline_payload) != nbytes:
                raise TransportError(f"rank {src} sent {len(header.inline_payload)} of {nbytes} bytes")
            if nbytes:
                sink(0, header.inline_payload)
            return array
        offset = 0
        for _ in range(header.num_chunks):
            chunk = yield
            if not isinstance(chunk, (bytes, memoryview)) or offset + len(chunk) > nbytes:
                raise TransportError(f"rank {src} sent more payload than its header announced")
            sink(offset, chunk)
            offset += len(chunk)
        if offset != nbytes:
            raise TransportError(f"rank {src} sent {offset} of {nbytes} announced bytes")
        return array

    def _allocate(self, src: int, header: peer_pb2.FrameHeader) -> np.ndarray:
        """The array a header announces (dtype and shape); TransportError where they do not add up."""
        dtype = DTYPES.get(header.dtype)
        shape = tuple(header.shape)
        if dtype is None or any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != header.nbytes:
            raise TransportError(
                f"rank {src} announced {header.nbytes} bytes of dtype {header.dtype!r} and shape {shape}, "
                "which do not match"
            )
        try:
            return np.empty(shape, dtype)
        except (MemoryError, ValueError) as exc:  # ValueError: over 64 dimensions, or too big with a zero
            raise TransportError(
                f"rank {src} announced an array of {header.nbytes} bytes and shape {shape} that cannot be made "
                f"({type(exc).__name__})"
            ) from None

    def fail(self, exc: PlaneError) -> PlaneError:
        """Fail this stream key here and, best effort, on every other rank of the group."""
        self.plane.fail_key(self.key, exc)
        exc = self.plane.failure(self.key) or exc  # a peer's error frame that came first is the cause
        header = peer_pb2.FrameHeader(src=self.me, failure=failure_message(exc))
        for idx in range(self.n):
            if idx != self.index and not self.plane.me.gone(self.ranks[idx]):
                self.plane.telling(asyncio.ensure_future(self._send_error(idx, header.SerializeToString())))
        return exc

    async def _send_error(self, idx: int, frame: bytes) -> None:
        # A stream of its own: the data stream may be mid-frame or blocked by flow control.
        stream = await best_effort(self.plane.stream(self.ranks[idx], self.key + ERROR_SUFFIX), 2.0)
        if stream is not None:
            await best_effort(stream.send_frame([frame]), 2.0)


def _num_chunks(nbytes: int) -> int:
    """Payload chunks after a frame's header: none when the payload rides inside it."""
    return 0 if nbytes <= INLINE_BYTES else -(-nbytes // CHUNK_BYTES)


class GrpcTransport:
    """The ``Comm`` of one group over gRPC; host (numpy) arrays (``GrpcPointToPoint`` adds send/recv)."""

    name: Transport = "grpc"
    device = False

    def __init__(
        self,
        plane: PeerPlane,
        loop: LoopThread,
        key: str,
        ranks: Sequence[int],
        me: int,
        timeout_s: float,
        *,
        direct: bool = True,
    ) -> None:
        self.channel = GrpcChannel(plane, key, ranks, me, direct=direct)
        self.plane = plane
        self.loop = loop
        self.key = key
        self.timeout_s = timeout_s
        self._scratch: np.ndarray | None = None
        self._thread_channel = ThreadChannel(self.channel, loop, self._expired)

    def _expired(self) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"collective on group '{self.key}' did not finish within {self.timeout_s:g} s; a peer may be "
            "slow or hung: raise PARAMPLANE_TIMEOUT if it is merely slow"
        )

    def _on_thread(self, deadline: float) -> ThreadChannel:
        """The group's frames on this thread for one op bounded by ``deadline``."""
        return self._thread_channel.begin(deadline)

    def _work(self, flat: np.ndarray) -> np.ndarray:
        """A reusable copy of ``flat`` (ops of a group run one at a time, so one buffer serves them all)."""
        if self._scratch is None or self._scratch.nbytes < flat.nbytes:
            self._scratch = np.empty(flat.nbytes, np.uint8)
        work = self._scratch[: flat.nbytes].view(flat.dtype)
        work[...] = flat
        return work

    def all_reduce(self, spec: OpSpec, flat: np.ndarray, op: str, deadline: float) -> None:
        ring.all_reduce(self._on_thread(deadline), spec, flat, op)

    def broadcast(self, spec: OpSpec, flat: np.ndarray, root: int, deadline: float) -> None:
        ring.broadcast(self._on_thread(deadline), spec, flat, root)

    def all_gather(self, spec: OpSpec, piece: np.ndarray, out: np.ndarray, deadline: float) -> None:
        ring.all_gather(self._on_thread(deadline), spec, piece, out)

    def reduce_scatter(
        self, spec: OpSpec, flat: np.ndarray, bounds: Bounds, op: str, out: np.ndarray, deadline: float
    ) -> None:
        work = self._work(flat)  # the algorithms reduce in place; the caller's input stays unchanged
        ring.reduce_scatter(self._on_thread(deadline), spec, work, bounds, op)
        a, b = bounds[self.channel.index]
        out[...] = work[a:b]

    def gather(
        self, spec: OpSpec, piece: np.ndarray, root: int, out: np.ndarray | None, deadline: float
    ) -> None:
        ring.gather(self._on_thread(deadline), spec, piece, root, out)

    def scatter(
        self, spec: OpSpec, pieces: Sequence[np.ndarray] | None, root: int, out: np.ndarray, deadline: float
    ) -> None:
        ring.scatter(self._on_thread(deadline), spec, pieces, root, out)

    def all_to_all(self, spec: OpSpec, flat: np.ndarray, out: np.ndarray, deadline: float) -> None:
        ring.all_to_all(self._on_thread(deadline), spec, flat, out)

    def all_to_allv(
        self, spec: OpSpec, flat: np.ndarray, out: np.ndarray, splits: Splits, deadline: float
    ) -> None:
        ring.all_to_allv(self._on_thread(deadline), spec, flat, out, splits)

    def barrier(self, spec: OpSpec, deadline: float) -> None:
        ring.barrier(self._on_thread(deadline), spec)

    def abort(self) -> None:
        return None  # a failed key fails every later frame on it

    def close(self) -> None:
        return None
