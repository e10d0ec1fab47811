"""Builds one group's transports on first use and picks the transport of each op from one table.

Set-up happens lazily because every member runs the same first op: the shm segment is made
by the group's first rank and found by the others through the coordinator's key/value store;
NCCL communicators are built on the device of the first GPU op; the hierarchical comm is
composed of an intra-host shm group and a cross-host gRPC group.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from paramplane.node.algorithms.hierarchical import HierarchicalComm
from paramplane.node.arrays import is_cupy
from paramplane.node.errors import PlaneError
from paramplane.node.loop import LoopThread
from paramplane.node.peer import PeerPlane
from paramplane.node.topology import Topology
from paramplane.node.transports.base import Comm, LocalComm, Transport, TransportPolicy
from paramplane.node.transports.grpc import GrpcTransport
from paramplane.node.transports.nccl import NCCL_OPS, nccl_moves
from paramplane.node.transports.p2p import GrpcPointToPoint
from paramplane.node.transports.shm import (
    SEGMENT_PREFIX,
    Segment,
    ShmComm,
    create_segment,
    open_segment,
    segment_size,
    sweep_stale_segments,
    unlink_segment,
)


class KV(Protocol):
    async def kv_set(self, key: str, value: bytes) -> None: ...
    async def kv_get(
        self, key: str, *, wait: bool = False, timeout_s: float | None = None
    ) -> bytes | None: ...
    async def barrier(self, name: str, *, ranks: Sequence[int] | None = None, timeout_s: float) -> None: ...


class TransportContext(Protocol):
    """What the factory needs from the node runtime."""

    loop: LoopThread
    plane: PeerPlane
    topology: Topology
    rank: int
    job_id: str
    transport: TransportPolicy
    shm_slot_bytes: int
    aborted: threading.Event

    @property
    def coord(self) -> KV: ...

    def abort_error(self) -> PlaneError: ...


class TransportFactory:
    """One group's transports (see the module docstring)."""

    def __init__(self, ctx: TransportContext, name: str, ranks: Sequence[int], timeout_s: float) -> None:
        self.ctx = ctx
        self.name = name
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        self.size = len(self.ranks)
        self.same_host = ctx.topology.same_host(self.ranks)
        self._hier_split = ctx.topology.hierarchy(self.ranks) if ctx.transport == "auto" else None
        self.grpc = GrpcTransport(ctx.plane, ctx.loop, name, self.ranks, ctx.rank, timeout_s)
        self.p2p = GrpcPointToPoint(
            ctx.plane, ctx.loop, f"{name}/p2p", self.ranks, ctx.rank, timeout_s, direct=True
        )
        self._local = LocalComm()
        self._shm: ShmComm | None = None
        self._hier: HierarchicalComm | None = None
        self.nccl: Any = None

    def choose(self, x: Any, op: str) -> Transport:
        """The transport of ``op`` on ``x``: array location x group topology x op, in one place."""
        policy = self.ctx.transport
        if self.size == 1:
            return "local"
        if is_cupy(x) and self.same_host and policy != "grpc" and op in NCCL_OPS and nccl_moves(x.dtype):
            return "nccl"
        if self.same_host and policy in ("auto", "shm"):
            return "shm"
        if self._hier_split is not None and op == "all_reduce":
            return "hier"
        return "grpc"

    def get(self, transport: Transport, x: Any = None) -> Comm:
        """The comm of ``transport``, set up on first use (``x``: the op's array, for NCCL's device)."""
        if transport == "local":
            return self._local
        if transport == "grpc":
            return self.grpc
        if transport == "shm":
            if self._shm is None:
                self._shm = self._setup_shm(self.name, self.ranks)
            return self._shm
        if transport == "hier":
            return self._hierarchy()
        assert transport == "nccl", transport
        return self._nccl(int(x.device.id))

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def _setup_shm(self, key: str, ranks: list[int]) -> ShmComm:
        slot = self.ctx.shm_slot_bytes
        size = segment_size(len(ranks), slot)
        index = ranks.index(self.ctx.rank)
        kv_key = f"shm/{key}"
        deadline = self._deadline()
        name = ""

        async def attach() -> Segment:
            nonlocal name
            if index == 0:
                sweep_stale_segments()  # what a rank killed during an earlier setup left on this host
                safe = "".join(c if c.isalnum() else "_" for c in key)
                name = f"{SEGMENT_PREFIX}{self.ctx.job_id[:12]}-{safe}-{uuid.uuid4().hex[:8]}"
                segment = create_segment(name, size)
                await self.ctx.coord.kv_set(kv_key, name.encode())
            else:
                value = await self.ctx.coord.kv_get(kv_key, wait=True, timeout_s=deadline - time.monotonic())
                assert value is not None
                name = value.decode()
                segment = open_segment(name, size)
            return segment

        segment = None
        try:
            segment = self.ctx.loop.run(attach())
            comm = ShmComm(segment, ranks, index, slot, self.ctx.aborted, self.ctx.abort_error)
            self.ctx.loop.run(
                self.ctx.coord.barrier(
                    f"shm/{key}", ranks=ranks, timeout_s=max(1.0, deadline - time.monotonic())
                )
            )
            return comm
        except BaseException:
            if segment is not None:
                segment.close()
            raise
        finally:
            if name:  # every rank: the creator may have died after publishing the name
                unlink_segment(name)

    def _hierarchy(self) -> HierarchicalComm:
        if self._hier is None:
            assert self._hier_split is not None
            local_groups, cross_groups = self._hier_split
            mine = next(h for h in local_groups if self.ctx.rank in h)
            li = mine.index(self.ctx.rank)
            local = self._setup_shm(f"{self.name}.l{local_groups.index(mine)}", mine)
            cross = GrpcTransport(
                self.ctx.plane,
                self.ctx.loop,
                f"{self.name}.x{li}",
                cross_groups[li],
                self.ctx.rank,
                self.timeout_s,
            )
            self._hier = HierarchicalComm(local, cross, len(mine), self.grpc)
        return self._hier

    def _nccl(self, device: int) -> Any:
        """The group's NCCL communicator, built on ``device`` by the first GPU op."""
        if self.nccl is None:
            import cupy

            from paramplane.node.transports.nccl import NcclComm, share_gpu_env

            share_gpu_env(self.ctx.topology, self.ctx.rank, cupy.cuda.runtime.getDeviceCount())
            index = self.ranks.index(self.ctx.rank)
            create = NcclComm.create(self.ctx.coord, self.name, self.ranks, index, device, self.timeout_s)
            self.nccl = self.ctx.loop.run(create)
        return self.nccl

    def abort(self) -> None:
        """After a failure: release GPU work queued behind the failed op."""
        if self.nccl is not None:
            self.nccl.abort()

    def close(self) -> None:
        for comm in (self._shm, self._hier, self.nccl):
            if comm is not None:
                comm.close()
