"""Collectives over a point-to-point frame channel: direct exchanges and rings.

Small payloads use direct exchanges (one round; every rank reduces the contributions in
rank order, so every rank ends with the same bits); large all-reduces use a ring
(reduce-scatter, then all-gather) so each rank sends and receives 2(n-1)/n of the buffer
on two streams. A received chunk is reduced as soon as it arrives, while the channel
receives the next one. Reductions here never divide: the engine applies ``mean`` once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import numpy as np

from paramplane.node.spec import OpSpec, reduce_ufunc, split_bounds

# At or below this many bytes an all-reduce uses the direct (latency-optimal) exchange.
SMALL_BYTES = 256 << 10
Sink = Callable[[int, bytes | memoryview], None]


class FrameChannel(Protocol):
    """Ordered, framed point-to-point messages between the ``n`` members of one group."""

    n: int
    index: int

    async def send(self, idx: int, spec: OpSpec, step: int, payload: np.ndarray | None) -> None: ...

    async def recv(self, idx: int, spec: OpSpec, step: int, nbytes: int, sink: Sink) -> None: ...


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


def copy_into(flat: np.ndarray, start: int) -> Sink:
    """A sink writing received bytes into ``flat`` from element ``start`` on."""
    itemsize = flat.itemsize

    def sink(offset: int, chunk: bytes | memoryview) -> None:
        s = start + offset // itemsize
        incoming = np.frombuffer(chunk, dtype=flat.dtype)
        flat[s : s + incoming.size] = incoming

    return sink


def reduce_into(flat: np.ndarray, start: int, op: str) -> Sink:
    """A sink reducing received elements into ``flat`` from element ``start`` on."""
    itemsize = flat.itemsize
    ufunc = reduce_ufunc(op)

    def sink(offset: int, chunk: bytes | memoryview) -> None:
        s = start + offset // itemsize
        incoming = np.frombuffer(chunk, dtype=flat.dtype)
        view = flat[s : s + incoming.size]
        ufunc(view, incoming, out=view)

    return sink


def _discard(_offset: int, _chunk: bytes | memoryview) -> None:
    return None


async def all_reduce(ch: FrameChannel, spec: OpSpec, flat: np.ndarray, op: str) -> None:
    if ch.n == 1:
        return
    if flat.nbytes <= SMALL_BYTES:
        await direct_reduce(ch, spec, flat, [(0, flat.size)] * ch.n, op)
    else:
        bounds = split_bounds(flat.size, ch.n)
        await ring_reduce_scatter(ch, spec, flat, bounds, op)
        await ring_all_gather(ch, spec, flat, bounds, step0=ch.n)


async def reduce_scatter(
    ch: FrameChannel, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], op: str
) -> None:
    """Reduce ``flat`` so that this rank's piece ``bounds[index]`` holds the reduction (others: scratch)."""
    if ch.n == 1:
        return
    if flat.nbytes <= SMALL_BYTES:
        await direct_reduce(ch, spec, flat, bounds, op)
    else:
        await ring_reduce_scatter(ch, spec, flat, bounds, op)


async def direct_reduce(
    ch: FrameChannel, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], op: str
) -> None:
    """One round: piece j goes to rank j (or everything to everyone), reduced in rank order."""
    me = ch.index
    a, b = bounds[me]
    parts: list[np.ndarray] = [np.empty(b - a, flat.dtype) for _ in range(ch.n)]
    parts[me] = flat[a:b]
    coros: list[Coroutine[Any, Any, Any]] = []
    for j in range(ch.n):
        if j == me:
            continue
        ja, jb = bounds[j]
        coros.append(ch.send(j, spec, 0, flat[ja:jb]))
        coros.append(ch.recv(j, spec, 0, (b - a) * flat.itemsize, copy_into(parts[j], 0)))
    await run_all(coros)
    ufunc = reduce_ufunc(op)
    acc = parts[0].copy()
    for j in range(1, ch.n):
        ufunc(acc, parts[j], out=acc)
    flat[a:b] = acc


async def ring_reduce_scatter(
    ch: FrameChannel, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], op: str
) -> None:
    """n-1 ring steps after which rank i holds the full reduction of piece i."""
    n, me = ch.n, ch.index
    right, left = (me + 1) % n, (me - 1) % n
    for step in range(n - 1):
        sa, sb = bounds[(me - step - 1) % n]
        ra, rb = bounds[(me - step - 2) % n]
        await run_all(
            [
                ch.send(right, spec, step, flat[sa:sb]),
                ch.recv(left, spec, step, (rb - ra) * flat.itemsize, reduce_into(flat, ra, op)),
            ]
        )


async def ring_all_gather(
    ch: FrameChannel, spec: OpSpec, flat: np.ndarray, bounds: list[tuple[int, int]], step0: int = 0
) -> None:
    """n-1 ring steps after which every rank holds every piece (rank i starts with piece i)."""
    n, me = ch.n, ch.index
    right, left = (me + 1) % n, (me - 1) % n
    for step in range(n - 1):
        sa, sb = bounds[(me - step) % n]
        ra, rb = bounds[(me - step - 1) % n]
        await run_all(
            [
                ch.send(right, spec, step0 + step, flat[sa:sb]),
                ch.recv(left, spec, step0 + step, (rb - ra) * flat.itemsize, copy_into(flat, ra)),
            ]
        )


async def all_gather(ch: FrameChannel, spec: OpSpec, piece: np.ndarray, out: np.ndarray) -> None:
    """``out`` (n * piece.size, flat) receives every rank's piece in rank order."""
    size = piece.size
    out[ch.index * size : (ch.index + 1) * size] = piece
    coros: list[Coroutine[Any, Any, Any]] = []
    for j in range(ch.n):
        if j != ch.index:
            coros.append(ch.send(j, spec, 0, piece))
            coros.append(ch.recv(j, spec, 0, piece.nbytes, copy_into(out, j * size)))
    await run_all(coros)


async def broadcast(ch: FrameChannel, spec: OpSpec, flat: np.ndarray, root: int) -> None:
    if ch.index == root:
        await run_all([ch.send(j, spec, 0, flat) for j in range(ch.n) if j != root])
    else:
        await ch.recv(root, spec, 0, flat.nbytes, copy_into(flat, 0))


async def gather(
    ch: FrameChannel, spec: OpSpec, piece: np.ndarray, root: int, out: np.ndarray | None
) -> None:
    if ch.index != root:
        await ch.send(root, spec, 0, piece)
        return
    assert out is not None
    size = piece.size
    out[root * size : (root + 1) * size] = piece
    await run_all(
        [ch.recv(j, spec, 0, piece.nbytes, copy_into(out, j * size)) for j in range(ch.n) if j != root]
    )


async def scatter(
    ch: FrameChannel, spec: OpSpec, pieces: Sequence[np.ndarray] | None, root: int, out: np.ndarray
) -> None:
    if ch.index == root:
        assert pieces is not None
        out[...] = pieces[root]
        await run_all([ch.send(j, spec, 0, pieces[j]) for j in range(ch.n) if j != root])
    else:
        await ch.recv(root, spec, 0, out.nbytes, copy_into(out, 0))


async def barrier(ch: FrameChannel, spec: OpSpec) -> None:
    coros: list[Coroutine[Any, Any, Any]] = []
    for j in range(ch.n):
        if j != ch.index:
            coros.append(ch.send(j, spec, 0, None))
            coros.append(ch.recv(j, spec, 0, 0, _discard))
    await run_all(coros)
