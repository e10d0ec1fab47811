"""Collectives over a point-to-point frame channel: direct exchanges and rings.

Small payloads use direct exchanges (one round; every rank reduces the contributions in
rank order, so every rank ends with the same bits); large all-reduces use a ring
(reduce-scatter, then all-gather) so each rank sends and receives 2(n-1)/n of the buffer.
They run on the thread of the op: ``send`` starts a frame (written from that thread when the
socket takes it at once, else by the event loop, in order) and ``recv`` reads one on that thread,
feeding each chunk to a sink as it arrives (a received chunk is reduced while the next one is on
its way); ``flush`` waits for the sends. Reductions here never divide: the engine applies ``mean`` once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from paramplane.node.spec import OpSpec, reduce_ufunc, split_bounds
from paramplane.node.transports.base import Splits

# At or below this many bytes an all-reduce uses the direct (latency-optimal) exchange.
SMALL_BYTES = 256 << 10
Sink = Callable[[int, bytes | memoryview], None]


class FrameChannel(Protocol):
    """Ordered, framed point-to-point messages between the ``n`` members of one group, from the op's thread."""

    n: int
    index: int

    def send(self, idx: int, spec: OpSpec, step: int, payload: np.ndarray | None) -> None:
        """Start sending ``payload`` (read until ``flush`` returns) to group index ``idx``, after the frames
        sent there before."""

    def recv(self, idx: int, spec: OpSpec, step: int, nbytes: int, sink: Sink) -> None:
        """Receive the next frame from group index ``idx``, checked against ``spec``, into ``sink``."""

    def flush(self) -> None:
        """Wait until every frame started by ``send`` has gone out."""

    def sent(self) -> bool:
        """Whether no frame started by ``send`` still reads the arrays it was given (small frames are copied
        as they are sent)."""


def copy_into(flat: np.ndarray, start: int) -> Sink:
    """A sink writing received bytes into ``flat`` from element ``start`` on."""
    itemsize = flat.itemsize

    def sink(offset: int, chunk: bytes | memoryview) -> None:
        s = start + offset // itemsize
        incoming = np.frombuffer(chunk, dtype=flat.dtype)
        flat[s : s + incoming.size] = incoming

    return sink


def reduce_into(flat: np.ndarray, start: int, op: str, *, first: bool = False) -> Sink:
    """A sink reducing received elements into ``flat`` from element ``start`` on (``first``: the received
    values are the left operand, as those of a lower rank)."""
    itemsize = flat.itemsize
    ufunc = reduce_ufunc(op)

    def sink(offset: int, chunk: bytes | memoryview) -> None:
        s = start + offset // itemsize
        incoming = np.frombuffer(chunk, dtype=flat.dtype)
        view = flat[s : s + incoming.size]
        if first:
            ufunc(incoming, view, out=view)
        else:
            ufunc(view, incoming, out=view)

    return sink


def _discard(_offset: int, _chunk: bytes | memoryview) -> None:
    return None


def all_reduce(ch: FrameChannel, spec: OpSpec, flat: np.ndarray, op: str) -> None:
    if ch.n == 1:
        return
    if flat.nbytes <= SMALL_BYTES:
        direct_reduce(ch, spec, flat, [(0, flat.size)] * ch.n, op)
    else:
        bounds = split_bounds(flat.size, ch.n)
        ring_reduce_scatter(ch, spec, flat, bounds, op)
        ring_all_gather(ch, spec, flat, bounds, step0=ch.n)
    ch.flush()


def reduce_scatter(
    ch: FrameChannel, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], op: str
) -> None:
    """Reduce ``flat`` so that this rank's piece ``bounds[index]`` holds the reduction (others: scratch)."""
    if ch.n == 1:
        return
    if flat.nbytes <= SMALL_BYTES:
        direct_reduce(ch, spec, flat, bounds, op)
    else:
        ring_reduce_scatter(ch, spec, flat, bounds, op)
    ch.flush()


def direct_reduce(
    ch: FrameChannel, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], op: str
) -> None:
    """One round: piece j goes to rank j (or everything to everyone), reduced in rank order."""
    me = ch.index
    a, b = bounds[me]
    for j in range(ch.n):
        if j != me:
            ja, jb = bounds[j]
            ch.send(j, spec, 0, flat[ja:jb])
    ufunc = reduce_ufunc(op)
    if ch.n == 2:  # one contribution, reduced in rank order (a + b, never b + a)
        nbytes = (b - a) * flat.itemsize
        if ch.sent():  # nothing sent reads flat any more: reduce each chunk into place as it comes
            ch.recv(1 - me, spec, 0, nbytes, reduce_into(flat, a, op, first=me == 1))
            return
        part = np.empty(b - a, flat.dtype)
        ch.recv(1 - me, spec, 0, nbytes, copy_into(part, 0))
        ch.flush()  # the piece sent reads flat[a:b]
        mine = flat[a:b]
        if me == 0:
            ufunc(mine, part, out=mine)
        else:
            ufunc(part, mine, out=mine)
        return
    parts: list[np.ndarray] = [np.empty(b - a, flat.dtype) for _ in range(ch.n)]
    parts[me] = flat[a:b]
    for j in range(ch.n):
        if j != me:
            ch.recv(j, spec, 0, (b - a) * flat.itemsize, copy_into(parts[j], 0))
    acc = parts[0].copy()
    for j in range(1, ch.n):
        ufunc(acc, parts[j], out=acc)
    ch.flush()
    flat[a:b] = acc


def ring_reduce_scatter(
    ch: FrameChannel, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], op: str
) -> None:
    """n-1 ring steps after which rank i holds the full reduction of piece i."""
    n, me = ch.n, ch.index
    right, left = (me + 1) % n, (me - 1) % n
    for step in range(n - 1):
        sa, sb = bounds[(me - step - 1) % n]
        ra, rb = bounds[(me - step - 2) % n]
        ch.send(right, spec, step, flat[sa:sb])
        ch.recv(left, spec, step, (rb - ra) * flat.itemsize, reduce_into(flat, ra, op))


def ring_all_gather(
    ch: FrameChannel, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], step0: int = 0
) -> None:
    """n-1 ring steps after which every rank holds every piece (rank i starts with piece i)."""
    n, me = ch.n, ch.index
    right, left = (me + 1) % n, (me - 1) % n
    for step in range(n - 1):
        sa, sb = bounds[(me - step) % n]
        ra, rb = bounds[(me - step - 1) % n]
        ch.send(right, spec, step0 + step, flat[sa:sb])
        ch.recv(left, spec, step0 + step, (rb - ra) * flat.itemsize, copy_into(flat, ra))


def all_gather(ch: FrameChannel, spec: OpSpec, piece: np.ndarray, out: np.ndarray) -> None:
    """``out`` (n * piece.size, flat) receives every rank's piece in rank order."""
    size = piece.size
    out[ch.index * size : (ch.index + 1) * size] = piece
    others = [j for j in range(ch.n) if j != ch.index]
    for j in others:
        ch.send(j, spec, 0, piece)
    for j in others:
        ch.recv(j, spec, 0, piece.nbytes, copy_into(out, j * size))
    ch.flush()


def broadcast(ch: FrameChannel, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    if ch.index == root:
        for j in range(ch.n):
            if j != root:
                ch.send(j, spec, 0, flat)
        ch.flush()
    else:
        ch.recv(root, spec, 0, flat.nbytes, copy_into(flat, 0))


def gather(ch: FrameChannel, spec: OpSpec, piece: np.ndarray, root: int, out: np.ndarray | None) -> None:
    if ch.index != root:
        ch.send(root, spec, 0, piece)
        ch.flush()
        return
    assert out is not None
    size = piece.size
    out[root * size : (root + 1) * size] = piece
    for j in range(ch.n):
        if j != root:
            ch.recv(j, spec, 0, piece.nbytes, copy_into(out, j * size))


def scatter(
    ch: FrameChannel, spec: OpSpec, pieces: Sequence[np.ndarray] | None, root: int, out: np.ndarray
) -> None:
    if ch.index == root:
        assert pieces is not None
        out[...] = pieces[root]
        for j in range(ch.n):
            if j != root:
                ch.send(j, spec, 0, pieces[j])
        ch.flush()
    else:
        ch.recv(root, spec, 0, out.nbytes, copy_into(out, 0))


def all_to_all(ch: FrameChannel, spec: OpSpec, flat: np.ndarray, out: np.ndarray) -> None:
    """``flat``'s piece ``j`` goes to index ``j``; ``out``'s piece ``j`` comes from index ``j``."""
    equal = [flat.size // ch.n] * ch.n
    _exchange(ch, spec, flat, out, equal, equal)


def all_to_allv(ch: FrameChannel, spec: OpSpec, flat: np.ndarray, out: np.ndarray, splits: Splits) -> None:
    """``all_to_all`` with pieces of ``splits``' sizes (``Comm.all_to_allv``)."""
    _exchange(ch, spec, flat, out, splits.sends(ch.index), splits.receives(ch.index))


def _exchange(
    ch: FrameChannel,
    spec: OpSpec,
    flat: np.ndarray,
    out: np.ndarray,
    sends: Sequence[int],
    receives: Sequence[int],
) -> None:
    """Piece ``j`` of ``flat`` (``sends[j]`` elements, in order) goes to index ``j`` as one frame; ``out``'s piece
    ``j`` (``receives[j]`` elements) comes from index ``j``. Each rank sends its n - 1 pieces, then receives."""
    me = ch.index
    at, into = Splits.starts(sends), Splits.starts(receives)
    out[into[me] : into[me] + receives[me]] = flat[at[me] : at[me] + sends[me]]
    others = [(me + k) % ch.n for k in range(1, ch.n)]  # each rank starts with its next neighbour
    for j in others:
        ch.send(j, spec, 0, flat[at[j] : at[j] + sends[j]])
    for j in others:
        ch.recv(j, spec, 0, receives[j] * flat.itemsize, copy_into(out, into[j]))
    ch.flush()


def barrier(ch: FrameChannel, spec: OpSpec) -> None:
    others = [j for j in range(ch.n) if j != ch.index]
    for j in others:
        ch.send(j, spec, 0, None)
    for j in others:
        ch.recv(j, spec, 0, 0, _discard)
    ch.flush()
