"""``ProcessGroup``: the collectives a script calls (DESIGN.md, Client API).

A thin layer over the group's engine (``paramplane.node.engine.GroupEngine``), which checks every op's
arguments before any communication, picks its transport and runs it in issue order. This layer gives the
user-facing signatures: torch / JAX tensors in and out (``__dlpack__``, zero-copy), ``async_op=True``
returning a ``Work``, and an ``*_async`` coroutine form of each op for asyncio scripts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from paramplane.all_to_all import uneven_all_to_all
from paramplane.node.arrays import from_foreign, is_cupy
from paramplane.node.counters import RankCounters
from paramplane.node.engine import SENT, GroupEngine
from paramplane.node.errors import TransportError
from paramplane.work import Work

T = TypeVar("T")
_SENT_WORK: Work[None] = Work(SENT, "send")  # every send that left at once (a done Work never changes)


def _then(fut: concurrent.futures.Future[Any], fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
    """A future of ``fn(fut's value)`` (``fut``'s error as it is)."""
    out: concurrent.futures.Future[T] = concurrent.futures.Future()

    def done(f: concurrent.futures.Future[Any]) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        try:
            out.set_result(fn(f.result()))
        except BaseException as err:
            out.set_exception(err)

    fut.add_done_callback(done)
    return out


def _is_tensor(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_cupy(x) or hasattr(x, "__dlpack__")


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
        return self._e.counters

    @property
    def tracer(self) -> Any:
        """This rank's Chrome tracer when ``PARAMPLANE_TRACE`` is set, else None."""
        return self._e.tracer

    def check(self) -> None:
        """Raise the group's failure (PeerLost, WorldAborted, ...) if it has one; else return."""
        self._e.check()

    def hosts(self) -> list[list[int]]:
        """Group ranks per host (hosts in node order, ranks ascending)."""
        return self._e.hosts()

    def new_subgroup(self, members: Sequence[int], *, timeout: float | None = None) -> ProcessGroup:
        """A group of the given members of this group (group ranks, this rank among them).

        Only those members call it, in the same order as each other (a rank grid makes every
        member create its groups in one order); see ``World.new_group``.
        """
        return ProcessGroup(self._e.new_subgroup(members, timeout))

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name} rank {self.rank}/{self.size} ranks {self.ranks}>"

    def _result(self, name: str, fut: concurrent.futures.Future[Any], async_op: bool) -> Any:
        """The op's value, or (``async_op``) its ``Work``."""
        if async_op:
            return Work(fut, f"{name} on group '{self.name}'")
        return fut.result()

    def _as(
        self, name: str, fut: concurrent.futures.Future[Any], async_op: bool, value: Callable[[Any], Any]
    ) -> Any:
        """``value(the op's value)`` (the caller's tensor, or a result in the caller's library), or its ``Work``."""
        if async_op:
            return Work(_then(fut, value), f"{name} on group '{self.name}'")
        return value(fut.result())

    # -- collectives -----------------------------------------------------------------------------
    def all_reduce(self, x: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        """Reduce ``x`` across the group in place (op: sum, mean, min, max, product); returns ``x``.

        ``x`` may also be any ``__dlpack__`` tensor (torch, JAX): it is reduced in place, zero-copy.
        """
        arr = x if type(x) is np.ndarray else from_foreign(x)[0]
        fut = self._e.all_reduce(arr, op, async_op=async_op)
        if arr is x:
            return self._result("all_reduce", fut, async_op)
        return self._as("all_reduce", fut, async_op, lambda _: x)

    def broadcast(self, x: Any, src: int = 0, *, async_op: bool = False) -> Any:
        """Overwrite ``x`` on every rank with ``src``'s ``x`` (``src`` is a group rank); returns ``x``."""
        arr = x if type(x) is np.ndarray else from_foreign(x)[0]
        fut = self._e.broadcast(arr, src, async_op=async_op)
        if arr is x:
            return self._result("broadcast", fut, async_op)
        return self._as("broadcast", fut, async_op, lambda _: x)

    def all_gather(self, x: Any, *, out: Any = None, async_op: bool = False) -> Any:
        """Every rank's ``x`` concatenated along axis 0 in group order (0-d inputs give shape (size,)).

        ``out`` (optional) receives the result, so a caller can reuse one buffer across steps.
        """
        arr, wrap = from_foreign(x)
        into, _ = from_foreign(out)
        fut = self._e.all_gather(arr, into, async_op=async_op)
        return self._as("all_gather", fut, async_op, wrap if out is None else lambda _: out)

    def reduce_scatter(self, x: Any, op: str = "sum", *, out: Any = None, async_op: bool = False) -> Any:
        """This rank's rows of the reduction of ``x`` along axis 0.

        Rows are split like ``numpy.array_split``: with R rows and n ranks, the first R % n ranks
        get R // n + 1 rows and the others R // n. ``x`` itself is left unchanged; ``out``
        (optional) receives the result.
        """
        arr, wrap = from_foreign(x)
        into, _ = from_foreign(out)
        fut = self._e.reduce_scatter(arr, op, into, async_op=async_op)
        return self._as("reduce_scatter", fut, async_op, wrap if out is None else lambda _: out)

    def all_to_all(
        self,
        x: Any,
        *,
        out: Any = None,
        in_splits: Sequence[int] | None = None,
        out_splits: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Any:
        """Exchange blocks of axis 0: block ``j`` of ``x`` goes to group rank ``j``, and the result's block ``j``
        is what rank ``j`` sent this rank (``torch.distributed.all_to_all_single``). Without split sizes the
        blocks are equal (axis 0 divides by the group's size). ``in_splits`` (rows to each rank) and
        ``out_splits`` (rows from each; left out: as many as each sends) make them uneven, as a mixture of
        experts routes tokens (``paramplane.all_to_all``); split sizes that disagree across ranks are a
        ``CollectiveMismatch`` on every rank. ``out`` (optional, not overlapping ``x``) receives the result."""
        arr, wrap = from_foreign(x)
        into, _ = from_foreign(out)
        if in_splits is None and out_splits is None:
            fut = self._e.all_to_all(arr, into, async_op=async_op)
        else:  # several collectives, run here: an async_op Work is done when returned
            fut = concurrent.futures.Future()
            fut.set_result(uneven_all_to_all(self, arr, in_splits, out_splits, into))
        return self._as("all_to_all", fut, async_op, wrap if out is None else lambda _: out)

    def gather(self, x: Any, dst: int = 0, *, async_op: bool = False) -> Any:
        """On ``dst``: every rank's ``x`` concatenated along axis 0 in group order; elsewhere None."""
        arr, wrap = from_foreign(x)
        fut = self._e.gather(arr, dst, async_op=async_op)
        return self._as("gather", fut, async_op, lambda got: None if got is None else wrap(got))

    def scatter(self, chunks: Sequence[Any] | Any, src: int = 0, *, async_op: bool = False) -> Any:
        """Group rank ``src`` passes one array per rank; every rank receives its own (returned).

        On ``src``, ``chunks`` is a sequence of ``size`` arrays of one shape and dtype; on the
        other ranks it is the receive buffer (an array of that shape and dtype), filled in place. Any
        ``__dlpack__`` tensor (torch, JAX) may stand for an array: the result is then one of its library.
        """
        if _is_tensor(chunks):  # the receive buffer (the engine refuses one on the source rank)
            out, _ = from_foreign(chunks)
            fut = self._e.scatter(None, out, src, async_op=async_op)
            return self._as("scatter", fut, async_op, lambda _: chunks)
        try:
            foreign = [from_foreign(c) for c in chunks]
        except TypeError:
            foreign = []  # not a sequence: the engine names what it needs
        pieces = [c for c, _ in foreign] if foreign or self.rank == src else None
        wrap = foreign[0][1] if foreign else (lambda a: a)
        fut = self._e.scatter(pieces, None, src, async_op=async_op)
        return self._as("scatter", fut, async_op, wrap)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Return once every rank of the group has called ``barrier``."""
        return self._result("barrier", self._e.barrier(async_op=async_op), async_op)

    # -- point to point --------------------------------------------------------------------------
    def send(self, x: Any, dst: int, *, async_op: bool = False) -> Any:
        """Send ``x`` to group rank ``dst`` (matched by a ``recv`` there, in order).

        With ``async_op`` do not modify ``x`` until the ``Work`` is done (a device array is copied to host first).
        """
        fut = self._e.send(x if type(x) is np.ndarray else from_foreign(x)[0], dst)
        if fut is SENT:
            return _SENT_WORK if async_op else None
        return self._result("send", fut, async_op)

    def recv(self, x: Any, src: int, *, async_op: bool = False) -> Any:
        """Fill ``x`` with what group rank ``src`` sends (same shape and dtype); returns ``x``."""
        if not async_op and type(x) is np.ndarray:
            return self._e.recv_now(x, src)  # no future: a pipeline's receives take this path per message
        arr = x if type(x) is np.ndarray else from_foreign(x)[0]
        fut = self._e.recv(arr, src, async_op=async_op)
        if arr is x:
            return self._result("recv", fut, async_op)
        return self._as("recv", fut, async_op, lambda _: x)

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
        if not async_op and like is None:
            return self._e.recv_now(None, src)
        return self._result("recv", self._e.recv_array(src, like, async_op=async_op), async_op)

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

    async def all_to_all_async(
        self,
        x: Any,
        *,
        out: Any = None,
        in_splits: Sequence[int] | None = None,
        out_splits: Sequence[int] | None = None,
    ) -> Any:
        return await self._await(
            self.all_to_all(x, out=out, in_splits=in_splits, out_splits=out_splits, async_op=True)
        )

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
