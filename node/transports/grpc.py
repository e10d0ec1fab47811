"""The gRPC transport: framed raw-byte streams of the peer plane, and the collectives over them.

``GrpcChannel`` sends and receives frames (a protobuf ``FrameHeader`` naming the op, then raw
chunks); the algorithms (direct exchange, ring) live in ``node/algorithms/ring.py``.
``GrpcTransport`` is the ``Comm``: it runs those algorithms on the runtime's event loop,
bounded by the op's deadline, failing the stream key on every member when the deadline passes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from paramplane.node.algorithms import ring
from paramplane.node.algorithms.ring import Sink
from paramplane.node.errors import CollectiveMismatch, CollectiveTimeout, PeerLost, PlaneError, TransportError
from paramplane.node.failures import failure_message
from paramplane.node.loop import LoopThread
from paramplane.node.peer import CHUNK_BYTES, ERROR_SUFFIX, PeerPlane
from paramplane.node.spec import OpSpec
from paramplane.node.transports.base import Bounds, Transport
from paramplane.protos import peer_pb2

# Payloads up to this size ride inside the frame header.
INLINE_BYTES = 64 << 10
T = TypeVar("T")


class GrpcChannel:
    """Framed messages between one group's members on one stream key of the peer plane
    (a ``FrameChannel`` for the algorithms in ``node/algorithms/ring.py``)."""

    def __init__(self, plane: PeerPlane, key: str, ranks: Sequence[int], me: int) -> None:
        self.plane = plane
        self.key = key
        self.ranks = list(ranks)
        self.me = me
        self.index = self.ranks.index(me)
        self.n = len(self.ranks)
        self._background: set[asyncio.Future[None]] = set()
        plane.register_stream_key(key, frozenset(self.ranks))

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

    async def _send(self, idx: int, spec: OpSpec, step: int, payload: np.ndarray | None) -> None:
        data = payload.reshape(-1).view(np.uint8) if payload is not None else np.empty(0, np.uint8)
        nbytes = data.nbytes
        inline = nbytes <= INLINE_BYTES
        num_chunks = 0 if inline else -(-nbytes // CHUNK_BYTES)
        header = peer_pb2.FrameHeader(
            group=spec.group,
            seq=spec.seq,
            op=spec.op,
            dtype=spec.dtype,
            shape=spec.shape,
            src=self.me,
            dst=self.ranks[idx],
            step=step,
            nbytes=nbytes,
            num_chunks=num_chunks,
            arg=spec.arg,
            inline_payload=data.tobytes() if inline and nbytes else b"",
        )
        stream = await self.plane.stream(self.ranks[idx], self.key)
        failure = self.plane.failure(self.key)
        if failure is not None:
            raise failure
        view = memoryview(data)  # type: ignore[arg-type]  # a gRPC stream copies each chunk to bytes; a TCP lane sends it as is
        chunks = (view[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES] for i in range(num_chunks))
        await stream.send_frame(itertools.chain([header.SerializeToString()], chunks))

    async def _recv(self, idx: int, spec: OpSpec, step: int, nbytes: int, sink: Sink) -> None:
        src = self.ranks[idx]
        inbox = self.plane.inbox(src, self.key)
        header = await inbox.get()
        if not isinstance(header, peer_pb2.FrameHeader):
            raise self.fail(
                TransportError(f"stream from rank {src} lost its framing (payload where a header was due)")
            )
        theirs = OpSpec(spec.group, header.seq, header.op, header.dtype, tuple(header.shape), header.arg)
        text = spec.mismatch(self.me, src, theirs)
        if text is None and (header.step != step or header.nbytes != nbytes):
            text = (
                f"collective mismatch in group '{spec.group}' at op #{spec.seq} {spec.describe()}: rank {src} "
                f"sent step {header.step} with {header.nbytes} bytes where rank {self.me} expected step {step} "
                f"with {nbytes} bytes"
            )
        if text is not None:
            raise self.fail(CollectiveMismatch(text))
        if header.num_chunks == 0:
            if len(header.inline_payload) != nbytes:
                raise self.fail(
                    TransportError(f"rank {src} sent {len(header.inline_payload)} of {nbytes} bytes")
                )
            if nbytes:
                sink(0, header.inline_payload)
            return
        offset = 0
        for _ in range(header.num_chunks):
            chunk = await inbox.get()
            if not isinstance(chunk, (bytes, memoryview)) or offset + len(chunk) > nbytes:
                raise self.fail(TransportError(f"rank {src} sent more payload than its header announced"))
            sink(offset, chunk)
            offset += len(chunk)
        if offset != nbytes:
            raise self.fail(TransportError(f"rank {src} sent {offset} of {nbytes} announced bytes"))

    def fail(self, exc: PlaneError) -> PlaneError:
        """Fail this stream key here and, best effort, on every other rank of the group."""
        self.plane.fail_key(self.key, exc)
        header = peer_pb2.FrameHeader(src=self.me, failure=failure_message(exc))
        for idx in range(self.n):
            if idx != self.index and self.ranks[idx] not in self.plane.lost:
                task = asyncio.ensure_future(self._send_error(idx, header.SerializeToString()))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        return exc

    async def _send_error(self, idx: int, frame: bytes) -> None:
        # A stream of its own: the data stream may be mid-frame or blocked by flow control.
        try:
            stream = await asyncio.wait_for(self.plane.stream(self.ranks[idx], self.key + ERROR_SUFFIX), 2.0)
            await asyncio.wait_for(stream.send_frame([frame]), 2.0)
        except BaseException:
            pass


class GrpcTransport:
    """The ``Comm`` (and ``PointToPoint``) of one group over gRPC; host (numpy) arrays."""

    name: Transport = "grpc"
    device = False

    def __init__(
        self, plane: PeerPlane, loop: LoopThread, key: str, ranks: Sequence[int], me: int, timeout_s: float
    ) -> None:
        self.channel = GrpcChannel(plane, key, ranks, me)
        self.plane = plane
        self.loop = loop
        self.key = key
        self.timeout_s = timeout_s
        self._scratch: np.ndarray | None = None

    def run(self, coro: Coroutine[Any, Any, T], deadline: float) -> T:
        """Run ``coro`` on the runtime's loop, bounded by ``deadline``; on expiry fail the key everywhere."""
        fut = self.loop.submit(coro)
        try:
            return fut.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            if fut.done():
                raise  # the op's own CollectiveTimeout (a TimeoutError too)
        exc = CollectiveTimeout(
            f"collective on group '{self.key}' did not finish within {self.timeout_s:g} s; a peer may be "
            "slow or hung: raise PARAMPLANE_TIMEOUT if it is merely slow"
        )
        self.loop.loop.call_soon_threadsafe(self.plane.fail_key, self.key, exc)
        fut.cancel()
        raise exc

    def _work(self, flat: np.ndarray) -> np.ndarray:
        """A reusable copy of ``flat`` (ops of a group run one at a time, so one buffer serves them all)."""
        if self._scratch is None or self._scratch.nbytes < flat.nbytes:
            self._scratch = np.empty(flat.nbytes, np.uint8)
        work = self._scratch[: flat.nbytes].view(flat.dtype)
        work[...] = flat
        return work

    def all_reduce(self, spec: OpSpec, flat: np.ndarray, op: str, deadline: float) -> None:
        self.run(ring.all_reduce(self.channel, spec, flat, op), deadline)

    def broadcast(self, spec: OpSpec, flat: np.ndarray, root: int, deadline: float) -> None:
        self.run(ring.broadcast(self.channel, spec, flat, root), deadline)

    def all_gather(self, spec: OpSpec, piece: np.ndarray, out: np.ndarray, deadline: float) -> None:
        self.run(ring.all_gather(self.channel, spec, piece, out), deadline)

    def reduce_scatter(
        self, spec: OpSpec, flat: np.ndarray, bounds: Bounds, op: str, out: np.ndarray, deadline: float
    ) -> None:
        work = self._work(flat)  # the algorithms reduce in place; the caller's input stays unchanged
        self.run(ring.reduce_scatter(self.channel, spec, work, bounds, op), deadline)
        a, b = bounds[self.channel.index]
        out[...] = work[a:b]

    def gather(
        self, spec: OpSpec, piece: np.ndarray, root: int, out: np.ndarray | None, deadline: float
    ) -> None:
        self.run(ring.gather(self.channel, spec, piece, root, out), deadline)

    def scatter(
        self, spec: OpSpec, pieces: Sequence[np.ndarray] | None, root: int, out: np.ndarray, deadline: float
    ) -> None:
        self.run(ring.scatter(self.channel, spec, pieces, root, out), deadline)

    def barrier(self, spec: OpSpec, deadline: float) -> None:
        self.run(ring.barrier(self.channel, spec), deadline)

    def send(self, spec: OpSpec, flat: np.ndarray, dst: int, deadline: float) -> None:
        self.run(self.channel.send(dst, spec, 0, flat), deadline)

    def recv(self, spec: OpSpec, flat: np.ndarray, src: int, deadline: float) -> None:
        self.run(self.channel.recv(src, spec, 0, flat.nbytes, ring.copy_into(flat, 0)), deadline)

    def abort(self) -> None:
        return None  # a failed key fails every later frame on it

    def close(self) -> None:
        return None
