"""One process group's engine: argument checks, ordering, transport choice, deadlines, failure state.

Every collective is checked before any communication, given the next sequence
number by the group's actor and run on one transport: ``shm`` (CPU ranks of
one host), ``nccl`` (cupy arrays, GPU ranks of one host), ``grpc`` (any
ranks), or hierarchically (intra-host shm reduce-scatter, inter-host gRPC
all-reduce of the shards, intra-host all-gather) for all-reduces spanning hosts.
After a failure the group stays failed: later ops raise the same error at once.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from paramplane.node.actor import OpActor
from paramplane.node.arrays import dtype_name, is_cupy
from paramplane.node.errors import CollectiveTimeout, PlaneError
from paramplane.node.grpc_ops import GrpcComm
from paramplane.node.loop import LoopThread
from paramplane.node.nccl import nccl_moves
from paramplane.node.peer import PeerPlane
from paramplane.node.shm import (
    SEGMENT_PREFIX,
    ShmComm,
    create_segment,
    open_segment,
    segment_size,
    slot_bytes_from_env,
    unlink_segment,
)
from paramplane.node.spec import OpSpec, check_reduce_op, split_bounds
from paramplane.node.topology import Topology

T = TypeVar("T")
TRANSPORTS = ("auto", "grpc", "shm")


class Tracer(Protocol):
    def record(
        self, name: str, group: str, seq: int, nbytes: int, start: float, end: float, transport: str
    ) -> None: ...
    def close(self) -> None: ...


class KV(Protocol):
    async def kv_set(self, key: str, value: bytes) -> None: ...
    async def kv_get(
        self, key: str, *, wait: bool = False, timeout_s: float | None = None
    ) -> bytes | None: ...
    async def barrier(self, name: str, *, ranks: Sequence[int] | None = None, timeout_s: float) -> None: ...


class PlaneContext(Protocol):
    """What a group needs from its node runtime."""

    loop: LoopThread
    plane: PeerPlane
    topology: Topology
    rank: int
    job_id: str
    transport: str
    aborted: threading.Event
    tracer: Tracer | None

    @property
    def coord(self) -> KV: ...

    def abort_error(self) -> PlaneError: ...

    def new_group(self, ranks: Sequence[int], timeout_s: float | None = None) -> GroupEngine: ...


def check_array(x: Any, what: str = "x", *, writable: bool = True) -> None:
    """ValueError for anything the plane cannot move in place."""
    if not (isinstance(x, np.ndarray) or is_cupy(x)):
        raise ValueError(f"{what} must be a numpy or cupy array, got {type(x).__name__}")
    dtype_name(x.dtype)
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{what} is not C-contiguous: pass np.ascontiguousarray({what}) (collectives work in place)"
        )
    # cupy arrays are always writable and their flags have no `writeable`.
    if writable and isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{what} is read-only: collectives write their result into it; pass a writable copy")


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
        self.p2p_actor = OpActor(f"{name}/p2p")
        self.failure: PlaneError | None = None
        self._grpc = GrpcComm(ctx.plane, name, self.ranks, ctx.rank)
        self._p2p = GrpcComm(ctx.plane, f"{name}/p2p", self.ranks, ctx.rank)
        self._p2p_seq: dict[tuple[int, int], int] = {}
        self._same_host = ctx.topology.same_host(self.ranks)
        self._hier = ctx.topology.hierarchy(self.ranks) if ctx.transport == "auto" else None
        self._shm: ShmComm | None = None
        self._local: ShmComm | None = None
        self._cross: GrpcComm | None = None
        self._nccl: Any = None
        self._scratch: np.ndarray | None = None

    # -- plumbing --------------------------------------------------------------------------------
    def progress(self) -> tuple[int, int]:
        return self.actor.issued, self.actor.completed

    def transport_for(self, x: Any, op: str) -> str:
        if self.size == 1:
            return "local"
        if is_cupy(x) and self._same_host and self.ctx.transport != "grpc" and nccl_moves(x.dtype):
            return "nccl"
        if self._same_host and self.ctx.transport in ("auto", "shm"):
            return "shm"
        if self._hier is not None and op == "all_reduce":
            return "hier"
        return "grpc"

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def check(self) -> None:
        """Raise the group's failure, if any (public form of the check every op makes first)."""
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
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
        p2p: bool = False,
    ) -> concurrent.futures.Future[T]:
        """Issue ``body(seq)`` in order; failures are recorded so the group stays failed."""

        def op(seq: int) -> T:
            self._raise_if_failed()
            start = time.monotonic()
            try:
                return body(seq)
            except PlaneError as exc:
                self.failure = self.failure or exc
                if self._nccl is not None:
                    self._nccl.abort()  # release GPU work queued behind the failed op
                raise
            finally:
                if self.ctx.tracer is not None:
                    self.ctx.tracer.record(name, self.name, seq, nbytes, start, time.monotonic(), transport)

        return (self.p2p_actor if p2p else self.actor).submit(op, async_op=async_op)

    def on_loop(self, coro: Coroutine[Any, Any, T], deadline: float, fail: Callable[[PlaneError], Any]) -> T:
        """Run a gRPC algorithm on the runtime's loop, bounded by ``deadline``."""
        fut = self.ctx.loop.submit(coro)
        try:
            return fut.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            if fut.done():
                raise  # the op's own CollectiveTimeout (a TimeoutError too)
        exc = CollectiveTimeout(
            f"collective on group '{self.name}' did not finish within {self.timeout_s:g} s; a peer may be "
            "slow or hung: raise PARAMPLANE_TIMEOUT if it is merely slow"
        )
        self.ctx.loop.loop.call_soon_threadsafe(fail, exc)
        fut.cancel()
        raise exc

    # -- transports set up on first use (every member runs the same first op) ----------------------
    def shm(self) -> ShmComm:
        if self._shm is None:
            self._shm = self._setup_shm(self.name, self.ranks)
        return self._shm

    def _setup_shm(self, key: str, ranks: list[int]) -> ShmComm:
        slot = slot_bytes_from_env()
        size = segment_size(len(ranks), slot)
        index = ranks.index(self.ctx.rank)
        kv_key = f"shm/{key}"
        deadline = self._deadline()
        name = ""

        async def attach() -> Any:
            nonlocal name
            if index == 0:
                safe = "".join(c if c.isalnum() else "_" for c in key)
                name = f"{SEGMENT_PREFIX}{self.ctx.job_id[:12]}-{safe}-{uuid.uuid4().hex[:8]}"
                mm = create_segment(name, size)
                await self.ctx.coord.kv_set(kv_key, name.encode())
            else:
                value = await self.ctx.coord.kv_get(kv_key, wait=True, timeout_s=deadline - time.monotonic())
                assert value is not None
                name = value.decode()
                mm = open_segment(name, size)
            return mm

        mm = None
        try:
            mm = self.ctx.loop.run(attach())
            comm = ShmComm(mm, ranks, index, slot, self.ctx.aborted, self.ctx.abort_error)
            self.ctx.loop.run(
                self.ctx.coord.barrier(
                    f"shm/{key}", ranks=ranks, timeout_s=max(1.0, deadline - time.monotonic())
                )
            )
            return comm
        except BaseException:
            if mm is not None:
                mm.close()
            raise
        finally:
            if index == 0 and name:
                unlink_segment(name)

    def hierarchy(self) -> tuple[ShmComm, GrpcComm, int]:
        assert self._hier is not None
        local_groups, cross_groups = self._hier
        mine = next(h for h in local_groups if self.ctx.rank in h)
        li = mine.index(self.ctx.rank)
        if self._local is None:
            self._local = self._setup_shm(f"{self.name}.l{local_groups.index(mine)}", mine)
        if self._cross is None:
            self._cross = GrpcComm(self.ctx.plane, f"{self.name}.x{li}", cross_groups[li], self.ctx.rank)
        return self._local, self._cross, len(mine)

    def hier_all_reduce(self, spec: OpSpec, flat: np.ndarray, op: str, deadline: float) -> None:
        """All-reduce across hosts: shm reduce-scatter, gRPC all-reduce of each shard, shm all-gather."""
        local, cross, num_local = self.hierarchy()
        piece = -(-flat.size // num_local)
        padded = np.zeros(piece * num_local, flat.dtype)
        padded[: flat.size] = flat
        bounds = [(i * piece, (i + 1) * piece) for i in range(num_local)]
        mine = np.empty(piece, flat.dtype)
        partial = "sum" if op == "mean" else op
        local.reduce_scatter(spec, padded, bounds, partial, mine, deadline)
        cross_spec = OpSpec(f"{spec.group}/cross", spec.seq, "all_reduce", spec.dtype, (piece,), partial)
        self.on_loop(
            cross.all_reduce(cross_spec, mine, partial),
            deadline,
            lambda exc: self.ctx.plane.fail_key(cross.key, exc),
        )
        local.all_gather(spec, mine, padded, deadline)
        flat[...] = padded[: flat.size]
        if op == "mean":
            np.true_divide(flat, self.size, out=flat, casting="unsafe")

    def nccl(self, device: int) -> Any:
        """The group's NCCL communicator, built on ``device`` by the first GPU op."""
        if self._nccl is None:
            import cupy

            from paramplane.node.nccl import NcclComm, share_gpu_env

            share_gpu_env(self.ctx.topology, self.ctx.rank, cupy.cuda.runtime.getDeviceCount())
            create = NcclComm.create(self.ctx.coord, self.name, self.ranks, self.rank, device, self.timeout_s)
            self._nccl = self.ctx.loop.run(create)
        return self._nccl

    def close(self) -> None:
        self.actor.close()
        self.p2p_actor.close()
        for comm in (self._shm, self._local):
            if comm is not None:
                comm.close()
        if self._nccl is not None:
            self._nccl.close()

    def scratch(self, dtype: Any, size: int) -> np.ndarray:
        """A reusable work buffer (ops of a group run one at a time, so one serves them all)."""
        nbytes = size * np.dtype(dtype).itemsize
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes].view(dtype)

    # -- argument helpers ------------------------------------------------------------------------
    def spec(self, seq: int, op: str, x: Any, arg: str = "") -> OpSpec:
        return OpSpec(self.name, seq, op, dtype_name(x.dtype), tuple(int(d) for d in x.shape), arg)

    def check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.size:
            raise ValueError(f"{what}={root} is not a rank of group '{self.name}' (size {self.size})")

    @staticmethod
    def check_reduce(op: str, x: Any) -> None:
        check_reduce_op(op, np.dtype(x.dtype))

    def split_rows(self, rows: int) -> list[tuple[int, int]]:
        return split_bounds(rows, self.size)
