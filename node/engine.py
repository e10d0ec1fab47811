"""One process group's engine: argument checks, issue order, failure state, deadlines, and running each op
on the transport the factory picks.

Every op is one call here: its arguments are checked (``ValueError``, before any communication), its
transport is picked once from the factory's table (``node/transports/factory.py``), and it runs in issue
order on the group's actor (inline when nothing is queued) through ``node/collective_ops.py``, which stages
device arrays through host memory for host transports and applies ``mean`` once. After a failure the
group stays failed: later ops raise the same error at once. ``ProcessGroup`` (``client/group.py``) is the
user-facing layer over this: foreign tensors, ``Work`` handles, asyncio forms.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from paramplane.node import collective_ops
from paramplane.node.actor import OpActor
from paramplane.node.arrays import array_module, dtype_name, is_cupy
from paramplane.node.checks import check_array, check_chunks, check_out, check_reduce
from paramplane.node.counters import RankCounters
from paramplane.node.engine_p2p import SENT, PointToPointOps
from paramplane.node.errors import DeviceCommError, PeerLost, PlaneError
from paramplane.node.spec import OpSpec, split_bounds
from paramplane.node.transports.base import Splits
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


_BARRIER_TOKEN = np.empty(0, np.uint8)


class GroupEngine(PointToPointOps):
    """The collectives of one group of global ``ranks`` as seen by rank ``ctx.rank``.

    Each op method returns a future, done on return unless ``async_op`` (then the op may run on the
    group's worker thread). Results are arrays of the caller's kind (numpy or cupy)."""

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

    # -- the group -------------------------------------------------------------------------------
    @property
    def tracer(self) -> Tracer | None:
        return self.ctx.tracer

    @property
    def counters(self) -> RankCounters:
        """This rank's counters for the coordinator's live view (bytes per transport, reports, commits)."""
        return self.ctx.counters

    def hosts(self) -> list[list[int]]:
        """Group ranks per host (hosts in node order, ranks ascending)."""
        index = {r: i for i, r in enumerate(self.ranks)}
        return [[index[r] for r in host] for host in self.ctx.topology.hosts(self.ranks)]

    def new_subgroup(self, members: Sequence[int], timeout_s: float | None = None) -> GroupEngine:
        """The engine of a group of the given members of this group (group ranks, this rank among them)."""
        members = list(members)
        picked = sorted({int(m) for m in members})
        if len(picked) != len(members) or not picked:
            raise ValueError(f"new_subgroup needs distinct group ranks, got {list(members)}")
        if picked[0] < 0 or picked[-1] >= self.size:
            raise ValueError(f"new_subgroup ranks must lie in [0, {self.size}), got {list(members)}")
        if self.rank not in picked:
            raise ValueError(f"group rank {self.rank} is not among the new subgroup's members {picked}")
        return self.ctx.new_group([self.ranks[m] for m in picked], timeout_s or self.timeout_s)

    # -- ordering, failure, deadlines --------------------------------------------------------------
    def progress(self) -> tuple[int, int]:
        return self.actor.issued, self.actor.completed

    def transport_for(self, x: Any, op: str) -> str:
        """The transport ``op`` on ``x`` runs on (the factory's table)."""
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

    def _issue(
        self,
        name: str,
        x: Any,
        arg: str,
        async_op: bool,
        run: Callable[..., T],
        *args: Any,
        shape: tuple[int, ...] | None = None,
    ) -> concurrent.futures.Future[T]:
        """Run ``run(comm, spec, deadline, *args)`` in issue order on the transport of ``name`` on ``x`` (picked
        here, once); a failure is recorded so the group stays failed. The spec that every rank must agree on
        has ``x``'s dtype and ``shape`` (by default ``x``'s)."""
        transport = self.transports.choose(x, name)
        stream = None
        if is_cupy(x):  # the op may run on the group's worker thread: give it the caller's device and stream
            from paramplane.node.transports.nccl import capture_stream

            stream = capture_stream()
        if shape is None:
            shape = x.shape if type(x) is np.ndarray else tuple(int(d) for d in x.shape)
        nbytes, dtype = int(x.nbytes), dtype_name(x.dtype)

        def op(seq: int) -> T:
            self.check()
            start = time.monotonic()
            try:
                comm = self.transports.get(transport, x)
                spec = OpSpec(self.name, seq, name, dtype, shape, arg)
                if stream is None:
                    result = run(comm, spec, self.deadline(), *args)
                else:
                    from paramplane.node.transports.nccl import on_stream

                    with on_stream(x, stream):
                        result = run(comm, spec, self.deadline(), *args)
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

    def _failed(self, exc: PlaneError) -> PlaneError:
        """Record an op's failure as the group's (the first one stays) and return what to raise. Blocking (a
        lost peer's cause is asked of the coordinator): never on the loop."""
        cause = self.ctx.cause_of_peer_lost(exc) if isinstance(exc, PeerLost) else exc
        self.failure = self.failure or cause
        self.transports.abort()
        if isinstance(exc, DeviceCommError):  # peers may wait inside NCCL kernels: tell every rank
            self.ctx.abort_world(exc)
        return cause

    def close(self) -> None:
        self.actor.close()
        self.recv_actor.close()
        self.transports.close()

    def check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"{what}={root} is not a rank of group '{self.name}' (size {self.size})")

    # -- collectives (x: a numpy or cupy array) --------------------------------------------------------
    def all_reduce(
        self, x: Any, op: str = "sum", *, async_op: bool = False
    ) -> concurrent.futures.Future[None]:
        """Reduce ``x`` across the group in place."""
        check_array(x)
        check_reduce(op, x)
        return self._issue("all_reduce", x, op, async_op, collective_ops.all_reduce, self.size, x, op)

    def broadcast(self, x: Any, src: int = 0, *, async_op: bool = False) -> concurrent.futures.Future[Any]:
        """Overwrite ``x`` with group rank ``src``'s (the future's value)."""
        check_array(x)
        self.check_root(src, "src")
        run = collective_ops.broadcast
        return self._issue("broadcast", x, f"src={src}", async_op, run, x, src, self.rank == src)

    def all_gather(
        self, x: Any, out: Any = None, *, async_op: bool = False
    ) -> concurrent.futures.Future[Any]:
        """Every rank's ``x`` along axis 0 in group order, into ``out`` or a new array (the future's value)."""
        check_array(x, writable=False)
        rows = x.shape[0] if x.ndim else 1
        shape = (rows * self.size, *x.shape[1:])
        check_out(out, shape, x)
        return self._issue("all_gather", x, "", async_op, collective_ops.all_gather, x, out, shape)

    def reduce_scatter(
        self, x: Any, op: str = "sum", out: Any = None, *, async_op: bool = False
    ) -> concurrent.futures.Future[Any]:
        """This rank's rows (``numpy.array_split`` of axis 0) of the reduction of ``x``, into ``out`` or a new
        array (the future's value); ``x`` stays unchanged."""
        check_array(x, writable=False)
        if x.ndim == 0:
            raise ValueError("reduce_scatter needs an array with at least one axis (it splits axis 0)")
        check_reduce(op, x)
        row = math.prod(x.shape[1:])
        rows = split_bounds(x.shape[0], self.size)
        bounds = [(a * row, b * row) for a, b in rows]
        a, b = rows[self.rank]
        shape = (b - a, *x.shape[1:])
        check_out(out, shape, x)
        run = collective_ops.reduce_scatter
        return self._issue("reduce_scatter", x, op, async_op, run, self.size, x, bounds, op, out, shape)

    def gather(self, x: Any, dst: int = 0, *, async_op: bool = False) -> concurrent.futures.Future[Any]:
        """On ``dst``, every rank's ``x`` along axis 0 in group order (a new array); elsewhere None."""
        check_array(x, writable=False)
        self.check_root(dst, "dst")
        rows = x.shape[0] if x.ndim else 1
        shape = (rows * self.size, *x.shape[1:]) if self.rank == dst else None
        return self._issue("gather", x, f"dst={dst}", async_op, collective_ops.gather, x, dst, shape)

    def scatter(
        self, chunks: Sequence[Any] | None, out: Any, src: int = 0, *, async_op: bool = False
    ) -> concurrent.futures.Future[Any]:
        """``src`` passes ``chunks`` (one array per rank, ``out`` None); every other rank its receive buffer
        ``out``. The future's value is the array this rank received into (a new one on ``src``)."""
        self.check_root(src, "src")
        if self.rank == src:
            if chunks is None:
                raise ValueError(
                    f"scatter on the source rank needs a sequence of {self.size} arrays (one per rank)"
                )
            check_chunks(chunks, self.size)
            out = array_module(chunks[0]).empty_like(chunks[0])
        else:
            if out is None:
                raise ValueError(
                    "scatter on a non-source rank needs the receive buffer (an array) as `chunks`"
                )
            check_array(out, "chunks")
            chunks = None
        run = collective_ops.scatter
        return self._issue("scatter", out, f"src={src}", async_op, run, chunks, src, out)

    def all_to_all(
        self, x: Any, out: Any = None, *, async_op: bool = False
    ) -> concurrent.futures.Future[Any]:
        """Split axis 0 of ``x`` into ``size`` equal blocks, block ``j`` to group rank ``j``; the result (``out``
        or a new array, the future's value) holds rank ``j``'s block for this rank at block ``j``."""
        check_array(x, writable=False)
        if x.ndim == 0 or x.shape[0] % self.size:
            raise ValueError(
                f"all_to_all splits axis 0 into {self.size} equal blocks (one per rank of group '{self.name}'): "
                f"got shape {tuple(x.shape)}"
            )
        check_out(out, tuple(x.shape), x)
        if out is not None and (out is x or array_module(x).may_share_memory(out, x)):
            raise ValueError("all_to_all: out must not overlap the input")
        return self._issue("all_to_all", x, "", async_op, collective_ops.all_to_all, x, out)

    def all_to_allv(self, x: Any, out: Any, rows: Sequence[Sequence[int]]) -> concurrent.futures.Future[Any]:
        """The exchange of an uneven ``all_to_all`` whose row counts every rank holds (``client/all_to_all.py``
        gathers and checks them first): ``rows[i][j]`` rows of axis 0 go from group rank ``i`` to ``j``; this
        rank's go from ``x`` (C-contiguous, in order), and what it receives fills ``out`` in order. The op's
        spec is the same on every rank: (all the rows of the table, *row shape*)."""
        check_array(x, writable=False)
        check_array(out)
        row = int(np.prod(x.shape[1:], dtype=np.int64))
        splits = Splits(tuple(tuple(int(c) * row for c in counts) for counts in rows))
        spec_shape = (sum(sum(counts) for counts in rows), *(int(d) for d in x.shape[1:]))
        run = collective_ops.all_to_allv
        return self._issue("all_to_all", x, "splits", False, run, x, out, splits, shape=spec_shape)

    def barrier(self, *, async_op: bool = False) -> concurrent.futures.Future[None]:
        """Done once every rank of the group has entered."""
        return self._issue("barrier", _BARRIER_TOKEN, "", async_op, collective_ops.barrier)


__all__ = ["SENT", "GroupEngine", "PlaneContext", "Tracer"]
