"""``ProcessGroup``: the collectives a script calls (DESIGN.md, Client API).

Every op checks its arguments before any communication, runs in issue order
on the group's engine, and takes ``async_op=True`` to return a ``Work``; each
also has an ``*_async`` coroutine form for asyncio scripts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from paramplane.node.arrays import array_module, device_of, from_foreign, is_cupy, to_host
from paramplane.node.counters import RankCounters
from paramplane.node.engine import SENT, GroupEngine, check_array
from paramplane.node.errors import TransportError
from paramplane.work import Work

_SENT_WORK: Work[None] = Work(SENT, "send")  # every send that left at once (a done Work never changes)


class ProcessGroup:
    """A group of ranks; ``rank`` and ``size`` are this rank's index and the group's size."""

    def __init__(self, engine: GroupEngine) -> None:
        self._e = engine

    def _configure(self, engine: GroupEngine) -> None:
        """Point this group at ``engine`` (a re-formed world's): wrappers holding the group go on with it."""
        self._e = engine

    @property
    def rank(self) -> int:
        return self._e.rank

    @property
    def size(self) -> int:
        return self._e.size

    @property
    def ranks(self) -> list[int]:
        """The global ranks of the members, in group order."""
        return list(self._e.ranks)

    @property
    def name(self) -> str:
        return self._e.name

    @property
    def timeout(self) -> float:
        return self._e.timeout_s

    @property
    def counters(self) -> RankCounters:
        """This rank's counters for the coordinator's live view (bytes per transport, reports, commits)."""
        return self._e.ctx.counters

    @property
    def tracer(self) -> Any:
        """This rank's Chrome tracer when ``PARAMPLANE_TRACE`` is set, else None."""
        return self._e.ctx.tracer

    def check(self) -> None:
        """Raise the group's failure (PeerLost, WorldAborted, ...) if it has one; else return."""
        self._e.check()

    def hosts(self) -> list[list[int]]:
        """Group ranks per host (hosts in node order, ranks ascending)."""
        topology = self._e.ctx.topology
        index = {r: i for i, r in enumerate(self._e.ranks)}
        return [[index[r] for r in host] for host in topology.hosts(self._e.ranks)]

    def new_subgroup(self, members: Sequence[int], *, timeout: float | None = None) -> ProcessGroup:
        """A group of the given members of this group (group ranks, this rank among them).

        Only those members call it, in the same order as each other (a rank grid makes every
        member create its groups in one order); see ``World.new_group``.
        """
        members = list(members)
        picked = sorted({int(m) for m in members})
        if len(picked) != len(members) or not picked:
            raise ValueError(f"new_subgroup needs distinct group ranks, got {list(members)}")
        if picked[0] < 0 or picked[-1] >= self.size:
            raise ValueError(f"new_subgroup ranks must lie in [0, {self.size}), got {list(members)}")
        if self.rank not in picked:
            raise ValueError(f"group rank {self.rank} is not among the new subgroup's members {picked}")
        ranks = [self._e.ranks[m] for m in picked]
        return ProcessGroup(self._e.ctx.new_group(ranks, timeout or self.timeout))

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name} rank {self.rank}/{self.size} ranks {self.ranks}>"

    # -- issuing ---------------------------------------------------------------------------------
    def _issue(self, name: str, x: Any, body: Callable[[int], Any], async_op: bool) -> Any:
        """Run ``body(seq)`` in issue order on the group's engine (inline, or as a ``Work``)."""
        e = self._e
        transport = e.transport_for(x, name)
        if is_cupy(x):
            # The op may run on the group's worker thread: give it the caller's device and stream.
            from paramplane.node.transports.nccl import capture_stream, on_stream

            stream, inner = capture_stream(), body

            def body(seq: int) -> Any:
                with on_stream(x, stream):
                    return inner(seq)

        fut = e.run(name, body, nbytes=int(x.nbytes), transport=transport, async_op=async_op)
        if async_op:
            return Work(fut, f"{name} on group '{self.name}'")
        return fut.result()

    # -- collectives -----------------------------------------------------------------------------
    def all_reduce(self, x: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        """Reduce ``x`` across the group in place (op: sum, mean, min, max, product); returns ``x``.

        ``x`` may also be any ``__dlpack__`` tensor (torch, JAX): it is reduced in place, zero-copy.
        """
        caller = x
        x, _ = from_foreign(x)
        check_array(x)
        e = self._e
        e.check_reduce(op, x)

        def body(seq: int) -> Any:
            e.all_reduce(e.spec(seq, "all_reduce", x, op), x, op)
            return caller

        return self._issue("all_reduce", x, body, async_op)

    def broadcast(self, x: Any, src: int = 0, *, async_op: bool = False) -> Any:
        """Overwrite ``x`` on every rank with ``src``'s ``x`` (``src`` is a group rank); returns ``x``."""
        caller = x
        x, _ = from_foreign(x)
        check_array(x)
        e = self._e
        e.check_root(src, "src")

        def body(seq: int) -> Any:
            e.broadcast(e.spec(seq, "broadcast", x, f"src={src}"), x, src)
            return caller

        return self._issue("broadcast", x, body, async_op)

    def all_gather(self, x: Any, *, out: Any = None, async_op: bool = False) -> Any:
        """Every rank's ``x`` concatenated along axis 0 in group order (0-d inputs give shape (size,)).

        ``out`` (optional) receives the result, so a caller can reuse one buffer across steps.
        """
        x, wrap = from_foreign(x)
        out_caller = out
        out, _ = from_foreign(out)
        check_array(x, writable=False)
        e = self._e
        rows = x.shape[0] if x.ndim else 1
        out_shape = (rows * e.size, *x.shape[1:])
        self._check_out(out, out_shape, x)
        xp = array_module(x)

        def body(seq: int) -> Any:
            result = out if out is not None else xp.empty(out_shape, x.dtype)
            e.all_gather(e.spec(seq, "all_gather", x), x, result)
            return wrap(result) if out is None else out_caller

        return self._issue("all_gather", x, body, async_op)

    @staticmethod
    def _check_out(out: Any, shape: tuple[int, ...], x: Any) -> None:
        if out is None:
            return
        check_array(out, "out")
        if tuple(out.shape) != shape or out.dtype != x.dtype or is_cupy(out) != is_cupy(x):
            raise ValueError(
                f"out must be a {type(x).__name__} of shape {shape} and dtype {x.dtype}, got "
                f"{type(out).__name__} {tuple(out.shape)} {out.dtype}"
            )

    def reduce_scatter(self, x: Any, op: str = "sum", *, out: Any = None, async_op: bool = False) -> Any:
        """This rank's rows of the reduction of ``x`` along axis 0.

        Rows are split like ``numpy.array_split``: with R rows and n ranks, the first R % n ranks
        get R // n + 1 rows and the others R // n. ``x`` itself is left unchanged; ``out``
        (optional) receives the result.
        """
        x, wrap = from_foreign(x)
        out_caller = out
        out, _ = from_foreign(out)
        check_array(x, writable=False)
        if x.ndim == 0:
            raise ValueError("reduce_scatter needs an array with at least one axis (it splits axis 0)")
        e = self._e
        e.check_reduce(op, x)
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        rows = e.split_rows(x.shape[0])
        bounds = [(a * row, b * row) for a, b in rows]
        a, b = rows[e.rank]
        out_shape = (b - a, *x.shape[1:])
        self._check_out(out, out_shape, x)
        xp = array_module(x)

        def body(seq: int) -> Any:
            result = out if out is not None else xp.empty(out_shape, x.dtype)
            e.reduce_scatter(e.spec(seq, "reduce_scatter", x, op), x, bounds, op, result)
            return wrap(result) if out is None else out_caller

        return self._issue("reduce_scatter", x, body, async_op)

    def gather(self, x: Any, dst: int = 0, *, async_op: bool = False) -> Any:
        """On ``dst``: every rank's ``x`` concatenated along axis 0 in group order; elsewhere None."""
        x, wrap = from_foreign(x)
        check_array(x, writable=False)
        e = self._e
        e.check_root(dst, "dst")
        xp = array_module(x)
        rows = x.shape[0] if x.ndim else 1
        out_shape = (rows * e.size, *x.shape[1:])

        def body(seq: int) -> Any:
            out = xp.empty(out_shape, x.dtype) if e.rank == dst else None
            e.gather(e.spec(seq, "gather", x, f"dst={dst}"), x, dst, out)
            return None if out is None else wrap(out)

        return self._issue("gather", x, body, async_op)

    def scatter(self, chunks: Sequence[Any] | Any, src: int = 0, *, async_op: bool = False) -> Any:
        """Group rank ``src`` passes one array per rank; every rank receives its own (returned).

        On ``src``, ``chunks`` is a sequence of ``size`` arrays of one shape and dtype; on the
        other ranks it is the receive buffer (an array of that shape and dtype), filled in place. Any
        ``__dlpack__`` tensor (torch, JAX) may stand for an array: the result is then one of its library.
        """
        e = self._e
        e.check_root(src, "src")
        if e.rank == src:
            if isinstance(chunks, (np.ndarray,)) or is_cupy(chunks) or hasattr(chunks, "__dlpack__"):
                raise ValueError(
                    f"scatter on the source rank needs a sequence of {e.size} arrays (one per rank)"
                )
            chunks = list(chunks)
            if len(chunks) != e.size:
                raise ValueError(
                    f"scatter on the source rank needs a sequence of {e.size} arrays (one per rank), "
                    f"got {len(chunks)}"
                )
            foreign = [from_foreign(c) for c in chunks]
            chunks, wrap = [c for c, _ in foreign], foreign[0][1]
            for i, c in enumerate(chunks):
                check_array(c, f"chunks[{i}]", writable=False)
                if c.shape != chunks[0].shape or c.dtype != chunks[0].dtype:
                    raise ValueError(
                        f"chunks[{i}] has shape {c.shape} and dtype {c.dtype}; chunks[0] has "
                        f"{chunks[0].shape} and {chunks[0].dtype}: every chunk must match"
                    )
            out = array_module(chunks[0]).empty_like(chunks[0])
            pieces: Sequence[Any] | None = chunks
            result = None
        else:
            if not (isinstance(chunks, np.ndarray) or is_cupy(chunks) or hasattr(chunks, "__dlpack__")):
                raise ValueError(
                    "scatter on a non-source rank needs the receive buffer (an array) as `chunks`"
                )
            result = chunks
            out, _ = from_foreign(chunks)
            check_array(out, "chunks")
            pieces = None

        def body(seq: int) -> Any:
            e.scatter(e.spec(seq, "scatter", out, f"src={src}"), pieces, src, out)
            return wrap(out) if result is None else result

        return self._issue("scatter", out, body, async_op)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Return once every rank of the group has called ``barrier``."""
        e = self._e
        token = np.empty(0, np.uint8)

        def body(seq: int) -> None:
            e.barrier(e.spec(seq, "barrier", token))

        return self._issue("barrier", token, body, async_op)

    # -- point to point --------------------------------------------------------------------------
    def _check_peer(self, peer: int, what: str) -> None:
        self._e.check_root(peer, what)
        if peer == self.rank:
            raise ValueError(f"{what}={peer} is this rank itself")

    def send(self, x: Any, dst: int, *, async_op: bool = False) -> Any:
        """Send ``x`` to group rank ``dst`` (matched by a ``recv`` there, in order).

        With ``async_op`` do not modify ``x`` until the ``Work`` is done (a device array is copied to host first).
        """
        if type(x) is np.ndarray and x.flags.c_contiguous:
            fut = self._e.send_small(x, dst)  # a pipeline's messages: the short path (node/transports/p2p.py)
            if fut is SENT:
                return _SENT_WORK if async_op else None
            if fut is not None:
                return self._p2p_result("send", fut, async_op)
        x, _ = from_foreign(x)
        check_array(x, writable=False)
        self._check_peer(dst, "dst")
        return self._p2p_result("send", self._e.p2p("send", to_host(x), dst), async_op)

    def recv(self, x: Any, src: int, *, async_op: bool = False) -> Any:
        """Fill ``x`` with what group rank ``src`` sends (same shape and dtype); returns ``x``."""
        if not async_op and type(x) is np.ndarray:
            flags = x.flags
            if flags.c_contiguous and flags.writeable and self._e.recv_small(x, src) is not None:
                return x
        caller = x
        x, _ = from_foreign(x)
        check_array(x)
        self._check_peer(src, "src")
        if not is_cupy(x):
            return self._p2p_result(
                "recv", self._e.p2p("recv", x, src, caller, blocking=not async_op), async_op
            )
        staged = np.empty(x.shape, x.dtype)
        fut = self._e.p2p("recv", staged, src, staged)

        def write_back(got: np.ndarray) -> Any:
            with device_of(x):  # the copy lands on x's GPU, not the current one
                x[...] = array_module(x).asarray(got)
            return caller

        return self._p2p_result("recv", fut, async_op, (x, write_back))

    def abort_point_to_point(self, reason: str) -> None:
        """Fail this group's point-to-point messages on every member with a ``TransportError`` naming
        ``reason``: their pending and later ``recv``s on this group raise it at once instead of waiting out the
        timeout (a pipeline stage that raised tells its neighbours so). The group's sends and receives are
        over after this; its collectives are not touched."""
        self._e.abort_p2p(TransportError(reason))

    def recv_array(self, src: int, *, like: Any = None, async_op: bool = False) -> Any:
        """Receive the next array ``src`` sends, in the dtype and shape it sent (its header carries them).

        The result is a new numpy array, or a cupy array on the current device when ``like`` is one.
        """
        if not async_op and (like is None or type(like) is np.ndarray):
            got = self._e.recv_small(None, src)
            if got is not None:
                return got
        self._check_peer(src, "src")
        fut = self._e.p2p("recv", None, src, blocking=not async_op)
        if like is None or not is_cupy(like):
            return self._p2p_result("recv", fut, async_op)
        return self._p2p_result("recv", fut, async_op, (like, array_module(like).asarray))

    def _p2p_result(
        self,
        name: str,
        fut: concurrent.futures.Future[Any],
        async_op: bool,
        device: tuple[Any, Callable[[Any], Any]] | None = None,
    ) -> Any:
        """The caller's value of a point-to-point op, or its ``Work``. ``device``: (a device array, the copy of
        the received host array to the device), which runs on the caller's stream (on the group's receive
        actor when asynchronous)."""
        if device is None:
            return Work(fut, f"{name} on group '{self.name}'") if async_op else fut.result()
        like, finish = device
        if not async_op:
            return finish(fut.result())
        from paramplane.node.transports.nccl import capture_stream, on_stream

        stream = capture_stream()

        def body(_seq: int) -> Any:
            got = fut.result()
            with on_stream(like, stream):
                return finish(got)

        return Work(self._e.recv_actor.submit(body, async_op=True), f"{name} on group '{self.name}'")

    # -- asyncio forms ---------------------------------------------------------------------------
    @staticmethod
    async def _await(work: Work[Any]) -> Any:
        fut: concurrent.futures.Future[Any] = work.future
        return await asyncio.wrap_future(fut)

    async def all_reduce_async(self, x: Any, op: str = "sum") -> Any:
        return await self._await(self.all_reduce(x, op, async_op=True))

    async def broadcast_async(self, x: Any, src: int = 0) -> Any:
        return await self._await(self.broadcast(x, src, async_op=True))

    async def all_gather_async(self, x: Any, *, out: Any = None) -> Any:
        return await self._await(self.all_gather(x, out=out, async_op=True))

    async def reduce_scatter_async(self, x: Any, op: str = "sum", *, out: Any = None) -> Any:
        return await self._await(self.reduce_scatter(x, op, out=out, async_op=True))

    async def gather_async(self, x: Any, dst: int = 0) -> Any:
        return await self._await(self.gather(x, dst, async_op=True))

    async def scatter_async(self, chunks: Sequence[Any] | Any, src: int = 0) -> Any:
        return await self._await(self.scatter(chunks, src, async_op=True))

    async def barrier_async(self) -> None:
        await self._await(self.barrier(async_op=True))

    async def send_async(self, x: Any, dst: int) -> None:
        await self._await(self.send(x, dst, async_op=True))

    async def recv_async(self, x: Any, src: int) -> Any:
        return await self._await(self.recv(x, src, async_op=True))

    async def recv_array_async(self, src: int, *, like: Any = None) -> Any:
        return await self._await(self.recv_array(src, like=like, async_op=True))
