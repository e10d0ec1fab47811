"""Collective algorithms over the peer plane's gRPC streams.

Small payloads use direct exchanges (one round, every rank reduces the
contributions in rank order, so every rank ends with the same bits); large
all-reduces use a ring (reduce-scatter, then all-gather) so each rank sends
and receives 2(n-1)/n of the buffer on two streams. A received chunk is
reduced as soon as it arrives, while gRPC receives the next one.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import numpy as np

from paramplane.node.errors import CollectiveMismatch, PeerLost, PlaneError, TransportError
from paramplane.node.peer import CHUNK_BYTES, ERROR_SUFFIX, PeerPlane, encode_failure
from paramplane.node.spec import OpSpec, reduce_ufunc, split_bounds
from paramplane.protos import peer_pb2

# At or below this many bytes an all-reduce uses the direct (latency-optimal) exchange.
SMALL_BYTES = 256 << 10
# Payloads up to this size ride inside the frame header.
INLINE_BYTES = 64 << 10
Sink = Callable[[int, bytes], None]


async def run_all(coros: Sequence[Coroutine[Any, Any, Any]]) -> None:
    """Run ``coros`` concurrently; on the first failure cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return
    try:
        _done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    failures = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
    if failures:
        raise failures[0]  # type: ignore[misc]


class GrpcComm:
    """One process group's collectives on one stream key of the peer plane."""

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
        chunks = (data[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES].tobytes() for i in range(num_chunks))
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
            if not isinstance(chunk, bytes) or offset + len(chunk) > nbytes:
                raise self.fail(TransportError(f"rank {src} sent more payload than its header announced"))
            sink(offset, chunk)
            offset += len(chunk)
        if offset != nbytes:
            raise self.fail(TransportError(f"rank {src} sent {offset} of {nbytes} announced bytes"))

    def fail(self, exc: PlaneError) -> PlaneError:
        """Fail this stream key here and, best effort, on every other rank of the group."""
        self.plane.fail_key(self.key, exc)
        header = peer_pb2.FrameHeader(src=self.me, error=encode_failure(exc))
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

    # -- sinks -----------------------------------------------------------------------------------
    @staticmethod
    def copy_into(flat: np.ndarray, start: int) -> Sink:
        itemsize = flat.itemsize

        def sink(offset: int, chunk: bytes) -> None:
            s = start + offset // itemsize
            incoming = np.frombuffer(chunk, dtype=flat.dtype)
            flat[s : s + incoming.size] = incoming

        return sink

    @staticmethod
    def reduce_into(flat: np.ndarray, start: int, op: str) -> Sink:
        itemsize = flat.itemsize
        ufunc = reduce_ufunc(op)

        def sink(offset: int, chunk: bytes) -> None:
            s = start + offset // itemsize
            incoming = np.frombuffer(chunk, dtype=flat.dtype)
            view = flat[s : s + incoming.size]
            ufunc(view, incoming, out=view)

        return sink

    # -- collectives (flat: 1-D contiguous numpy arrays) ------------------------------------------
    async def all_reduce(self, spec: OpSpec, flat: np.ndarray, op: str) -> None:
        if self.n > 1:
            if flat.nbytes <= SMALL_BYTES:
                await self._direct_reduce(spec, flat, [(0, flat.size)] * self.n, op)
            else:
                bounds = split_bounds(flat.size, self.n)
                await self.ring_reduce_scatter(spec, flat, bounds, op)
                await self.ring_all_gather(spec, flat, bounds, step0=self.n)
        if spec.op == "all_reduce" and op == "mean":
            np.true_divide(flat, self.n, out=flat, casting="unsafe")

    async def reduce_scatter(
        self, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], op: str
    ) -> None:
        """Reduce ``flat`` so that this rank's piece ``bounds[index]`` holds the reduction (others: scratch)."""
        if self.n > 1:
            if flat.nbytes <= SMALL_BYTES:
                await self._direct_reduce(spec, flat, bounds, op)
            else:
                await self.ring_reduce_scatter(spec, flat, bounds, op)
        if op == "mean":
            a, b = bounds[self.index]
            np.true_divide(flat[a:b], self.n, out=flat[a:b], casting="unsafe")

    async def _direct_reduce(
        self, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], op: str
    ) -> None:
        """One round: piece j goes to rank j (or everything to everyone), reduced in rank order."""
        me = self.index
        a, b = bounds[me]
        parts: list[np.ndarray] = [np.empty(b - a, flat.dtype) for _ in range(self.n)]
        parts[me] = flat[a:b]
        coros: list[Coroutine[Any, Any, Any]] = []
        for j in range(self.n):
            if j == me:
                continue
            ja, jb = bounds[j]
            coros.append(self.send(j, spec, 0, flat[ja:jb]))
            coros.append(self.recv(j, spec, 0, (b - a) * flat.itemsize, self.copy_into(parts[j], 0)))
        await run_all(coros)
        ufunc = reduce_ufunc(op)
        acc = parts[0].copy()
        for j in range(1, self.n):
            ufunc(acc, parts[j], out=acc)
        flat[a:b] = acc

    async def ring_reduce_scatter(
        self, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], op: str
    ) -> None:
        """n-1 ring steps after which rank i holds the full reduction of piece i."""
        n, me = self.n, self.index
        right, left = (me + 1) % n, (me - 1) % n
        for step in range(n - 1):
            sa, sb = bounds[(me - step - 1) % n]
            ra, rb = bounds[(me - step - 2) % n]
            await run_all(
                [
                    self.send(right, spec, step, flat[sa:sb]),
                    self.recv(left, spec, step, (rb - ra) * flat.itemsize, self.reduce_into(flat, ra, op)),
                ]
            )

    async def ring_all_gather(
        self, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], step0: int = 0
    ) -> None:
        """n-1 ring steps after which every rank holds every piece (rank i starts with piece i)."""
        n, me = self.n, self.index
        right, left = (me + 1) % n, (me - 1) % n
        for step in range(n - 1):
            sa, sb = bounds[(me - step) % n]
            ra, rb = bounds[(me - step - 1) % n]
            await run_all(
                [
                    self.send(right, spec, step0 + step, flat[sa:sb]),
                    self.recv(left, spec, step0 + step, (rb - ra) * flat.itemsize, self.copy_into(flat, ra)),
                ]
            )

    async def all_gather(self, spec: OpSpec, piece: np.ndarray, out: np.ndarray) -> None:
        """``out`` (n * piece.size, flat) receives every rank's piece in rank order."""
        size = piece.size
        out[self.index * size : (self.index + 1) * size] = piece
        coros: list[Coroutine[Any, Any, Any]] = []
        for j in range(self.n):
            if j != self.index:
                coros.append(self.send(j, spec, 0, piece))
                coros.append(self.recv(j, spec, 0, piece.nbytes, self.copy_into(out, j * size)))
        await run_all(coros)

    async def broadcast(self, spec: OpSpec, flat: np.ndarray, root: int) -> None:
        if self.index == root:
            await run_all([self.send(j, spec, 0, flat) for j in range(self.n) if j != root])
        else:
            await self.recv(root, spec, 0, flat.nbytes, self.copy_into(flat, 0))

    async def gather(self, spec: OpSpec, piece: np.ndarray, root: int, out: np.ndarray | None) -> None:
        if self.index != root:
            await self.send(root, spec, 0, piece)
            return
        assert out is not None
        size = piece.size
        out[root * size : (root + 1) * size] = piece
        await run_all(
            [
                self.recv(j, spec, 0, piece.nbytes, self.copy_into(out, j * size))
                for j in range(self.n)
                if j != root
            ]
        )

    async def scatter(
        self, spec: OpSpec, pieces: Sequence[np.ndarray] | None, root: int, out: np.ndarray
    ) -> None:
        if self.index == root:
            assert pieces is not None
            out[...] = pieces[root]
            await run_all([self.send(j, spec, 0, pieces[j]) for j in range(self.n) if j != root])
        else:
            await self.recv(root, spec, 0, out.nbytes, self.copy_into(out, 0))

    async def barrier(self, spec: OpSpec) -> None:
        coros: list[Coroutine[Any, Any, Any]] = []
        for j in range(self.n):
            if j != self.index:
                coros.append(self.send(j, spec, 0, None))
                coros.append(self.recv(j, spec, 0, 0, lambda _o, _c: None))
        await run_all(coros)

    async def send_to(self, spec: OpSpec, flat: np.ndarray, dst: int) -> None:
        await self.send(dst, spec, 0, flat)

    async def recv_from(self, spec: OpSpec, flat: np.ndarray, src: int) -> None:
        await self.recv(src, spec, 0, flat.nbytes, self.copy_into(flat, 0))
