"""The node runtime inside every rank process: join, heartbeats, abort watch, peer plane, groups.

It owns an asyncio loop on its own thread (so synchronous scripts and asyncio
scripts use it alike), the coordinator client, the peer plane and one
``GroupEngine`` per process group. A coordinator abort, a lost peer or a
shutdown fails every pending op with a typed error at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from paramplane.node.coord_client import CoordinatorClient, Membership, WatchEventInfo
from paramplane.node.counters import RankCounters
from paramplane.node.engine import GroupEngine, Tracer
from paramplane.node.errors import (
    CoordinatorUnavailable,
    DeviceCommError,
    PeerLost,
    PlaneClosed,
    PlaneError,
    WorldAborted,
)
from paramplane.node.loop import LoopThread
from paramplane.node.peer import PeerPlane, TlsConfig
from paramplane.node.topology import Topology
from paramplane.node.transports.base import POLICIES, TransportPolicy
from paramplane.node.transports.shm import DEFAULT_SLOT_BYTES, slot_bytes
from paramplane.protos.net import check_seconds, is_loopback, parse_address, within

log = logging.getLogger("paramplane.node")


@dataclass
class RuntimeConfig:
    """How a rank joins its world (``pp.init`` fills it from arguments and PARAMPLANE_* variables)."""

    coordinator: str
    """host:port of the coordinator."""
    world_size: int = 0
    """Expected world size; 0 accepts the coordinator's."""
    rank_hint: int = -1
    """Requested rank (the launcher passes one); -1 lets the coordinator choose."""
    token: str | None = field(default=None, repr=False)
    """The job token every RPC carries (coordinator and peers)."""
    host_id: str = field(default_factory=socket.gethostname)
    """Ranks with the same host id share a host: they get consecutive ranks and use shm / NCCL."""
    timeout_s: float = 300.0
    """Default timeout of every group's collectives (and of group setup)."""
    join_timeout_s: float = 300.0
    """How long to wait for the world to form."""
    replacement: bool = False
    """This rank replaces a lost one: while the current world is still full, wait (within the join
    timeout) for its survivors to re-form it (``World.reform()``) and join the new epoch."""
    bind_host: str = "127.0.0.1"
    """Address the peer server listens on; set it to reach peers on other hosts."""
    agent: str = ""
    """``unix:PATH`` of this host's agent (``paramplane launch`` sets it): coordinator calls go through the
    agent, which speaks for all of the host's ranks; empty: straight to the coordinator."""
    advertise_host: str | None = None
    """Address other ranks use to reach this one (default: bind_host)."""
    transport: TransportPolicy = "auto"
    """auto (shm within a host, hierarchical across hosts, gRPC otherwise), grpc or shm."""
    shm_slot_mb: float = DEFAULT_SLOT_BYTES / (1 << 20)
    """Shared-memory slot per rank and bank in MiB (an op moves this much per round)."""
    tls: TlsConfig | None = field(default=None, repr=False)
    """TLS for the data plane."""
    tcp_lane: bool = True
    """Carry data frames between ranks on raw TCP lanes (node/lane.py) instead of gRPC streams;
    off under TLS (lanes are plaintext) or with PARAMPLANE_TCP_LANE=0."""
    unix_lane: bool = True
    """Peers on the same machine (and network namespace) reach this rank's lane through an abstract Unix
    socket (Linux) instead of loopback TCP; 0 keeps TCP (to measure the inter-host path on one machine)."""
    coordinator_root_cert: bytes | None = field(default=None, repr=False)
    """Root certificate to verify a TLS coordinator."""
    tracer: Tracer | None = None
    """Receives one record per collective (PARAMPLANE_TRACE)."""

    def __post_init__(self) -> None:
        parse_address(self.coordinator, "coordinator (PARAMPLANE_COORDINATOR)")
        if self.agent and not self.agent.startswith("unix:"):
            raise ValueError(f"agent (PARAMPLANE_AGENT) must be unix:PATH, got {self.agent!r}")
        if self.world_size < 0:
            raise ValueError(f"world_size must be >= 0, got {self.world_size}")
        check_seconds(self.timeout_s, "timeout_s (PARAMPLANE_TIMEOUT)")
        check_seconds(self.join_timeout_s, "join_timeout_s (PARAMPLANE_JOIN_TIMEOUT)")
        slot_bytes(self.shm_slot_mb)  # ValueError for a bad size
        if self.transport not in POLICIES:
            raise ValueError(
                f"transport must be one of {POLICIES}, got {self.transport!r} (PARAMPLANE_TRANSPORT)"
            )
        if not is_loopback(self.bind_host) and not self.token:
            raise ValueError(
                f"refusing to serve the data plane on {self.bind_host} without a job token (PARAMPLANE_TOKEN)"
            )


SHUTDOWN_GRACE_S = 5.0
# A rank leaves after its plane has delivered what it sent (``_teardown``); a receive still waiting for a lane or
# frame from it fails this long after its "left" event (slack for the receiver's own loop, not for the sender).
LEFT_FLUSH_S = 1.0
ENV_OF = {
    "coordinator": "PARAMPLANE_COORDINATOR",
    "world_size": "PARAMPLANE_WORLD_SIZE",
    "rank_hint": "PARAMPLANE_RANK",
    "host_id": "PARAMPLANE_HOST_ID",
    "timeout_s": "PARAMPLANE_TIMEOUT",
    "join_timeout_s": "PARAMPLANE_JOIN_TIMEOUT",
    "replacement": "PARAMPLANE_REPLACEMENT",
    "bind_host": "PARAMPLANE_BIND",
    "agent": "PARAMPLANE_AGENT",
    "advertise_host": "PARAMPLANE_ADVERTISE",
    "transport": "PARAMPLANE_TRANSPORT",
    "shm_slot_mb": "PARAMPLANE_SHM_SLOT_MB",
    "tcp_lane": "PARAMPLANE_TCP_LANE",
    "unix_lane": "PARAMPLANE_UNIX_LANE",
}
"""The PARAMPLANE_* variable that sets each plain RuntimeConfig field (``pp.init`` reads them, parsed by the
field's type; its arguments win). token, tls, coordinator_root_cert and tracer come from files and folders
that PARAMPLANE_TOKEN(_FILE), PARAMPLANE_TLS_* and PARAMPLANE_TRACE name."""


def group_name(members: Sequence[int], k: int) -> str:
    """The name of the ``k``-th group over ``members`` (short, and the same on every member)."""
    if len(members) <= 8:
        label = "-".join(map(str, members))
    else:
        digest = hashlib.sha1(",".join(map(str, members)).encode()).hexdigest()[:8]
        label = f"{members[0]}..{members[-1]}~{digest}"
    return f"g[{label}]" + (f"#{k}" if k else "")


class NodeRuntime:
    """One rank's runtime. ``start()`` joins the world; ``shutdown()`` leaves it."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.loop = LoopThread()
        self.plane = PeerPlane(
            token=config.token,
            bind_host=config.bind_host,
            advertise_host=config.advertise_host,
            tls=config.tls,
            lane=config.tcp_lane,
            unix_lane=config.unix_lane,
        )
        self.transport: TransportPolicy = config.transport
        self.shm_slot_bytes = slot_bytes(config.shm_slot_mb)
        self.tracer = config.tracer
        self.counters = RankCounters()
        self.aborted = threading.Event()
        self._abort_exc: PlaneError | None = None
        self._groups: dict[str, GroupEngine] = {}
        self._num_groups_of: dict[tuple[int, ...], int] = {}
        self._tasks: list[asyncio.Future[Any]] = []
        self._closed = False
        self._coord: CoordinatorClient | None = None
        self.membership: Membership
        self.topology: Topology
        self.rank = -1
        self.job_id = ""

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> Membership:
        try:
            return self.loop.run(self._start())
        except BaseException:
            self.loop.run(self._teardown(), timeout=10)
            self.loop.stop()
            raise

    async def _start(self) -> Membership:
        c = self.config
        self._coord = CoordinatorClient(
            c.agent or c.coordinator, token=c.token, tls_root_cert=c.coordinator_root_cert
        )
        address = await self.plane.start()
        m = await self.coord.join(
            host_id=c.host_id,
            peer_address=address,
            instance_id=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
            rank_hint=c.rank_hint,
            world_size=c.world_size,
            timeout_s=c.join_timeout_s,
            replacement=c.replacement,
        )
        self.membership = m
        self.rank = m.rank
        self.job_id = m.job_id
        self.topology = Topology(m.peers)
        self.plane.configure(m.rank, m.job_id, {p.rank: p.address for p in m.peers})
        self._tasks = [asyncio.ensure_future(self._heartbeats()), asyncio.ensure_future(self._watch())]
        return m

    async def _heartbeats(self) -> None:
        """Beat every interval; ride out coordinator blips shorter than the heartbeat timeout, and past
        it fail every pending and later op with CoordinatorUnavailable (no failure detection is left)."""
        m = self.membership
        interval = max(0.05, m.heartbeat_interval_s)
        limit = m.heartbeat_timeout_s if m.heartbeat_timeout_s > 0 else 10.0
        last_ok = time.monotonic()
        suspect_since: float | None = None
        while True:
            device_error = self._device_comm_error()
            if device_error is not None:
                # A dead peer shows here first as NCCL's remote error: give the coordinator its heartbeat
                # timeout to name the rank (the beats below then abort with PeerLost) before blaming NCCL.
                if device_error.peer_may_be_lost and suspect_since is None:
                    suspect_since = time.monotonic()
                    log.warning(
                        "%s; waiting up to %g s for the coordinator to name a lost peer", device_error, limit
                    )
                if suspect_since is None or time.monotonic() - suspect_since > limit + 2 * interval:
                    await self._abort_world(device_error)
                    return
            try:
                await self._beat(max(interval, 1.0))
                last_ok = time.monotonic()
            except (PlaneError, asyncio.TimeoutError) as exc:
                silent = time.monotonic() - last_ok
                if silent > limit:
                    self._abort(
                        CoordinatorUnavailable(
                            f"the coordinator at {self.config.coordinator} has not answered for {silent:.1f} s "
                            f"(heartbeat timeout {limit:g} s; last error: {exc or type(exc).__name__}); no rank can "
                            "be told of failures any more: stop, and restart the job from its last checkpoint"
                        )
                    )
                    return
                log.warning("heartbeat failed (%.1f s without an answer): %s", silent, exc)
            await asyncio.sleep(interval)

    async def _beat(self, timeout: float) -> None:
        """One heartbeat with this rank's progress; an aborted world or a lost rank in the answer aborts here.
        Raises PlaneError or TimeoutError when the coordinator does not answer."""
        progress = {name: g.progress() for name, g in list(self._groups.items())}
        try:
            abort = await within(self.coord.heartbeat(progress, self.counters.snapshot()), timeout)
        except (WorldAborted, PeerLost) as exc:
            self._abort(exc)
            return
        if abort is not None:
            self._abort_from(abort)

    def _abort_from(self, event: WatchEventInfo) -> None:
        """The coordinator's abort, however it arrived (watch stream or heartbeat): the same error either way."""
        if event.lost and 0 <= event.rank != self.rank:
            self.plane.lost.add(event.rank)  # told no error and no goodbye, not waited for at shutdown
            self._abort(PeerLost(f"rank {event.rank} was lost: {event.reason}", event.rank))
        else:
            self._abort(WorldAborted(f"the world was aborted: {event.reason}", event.rank))

    async def _watch(self) -> None:
        try:
            async for event in self.coord.watch():
                if event.kind == "abort":
                    self._abort_from(event)
                    return
                if event.kind == "left" and event.rank != self.rank:
                    self.plane.peer_left(event.rank)
                    asyncio.get_running_loop().call_later(LEFT_FLUSH_S, self.plane.sender_left, event.rank)
                if event.kind == "shutdown" and not self._closed:
                    self._abort(WorldAborted("the coordinator shut down"))
                    return
        except PlaneError as exc:
            if not self._closed:
                log.warning("lost the coordinator's watch stream: %s", exc)

    def _abort(self, exc: PlaneError, *, waits: bool = True) -> None:
        """Fail every pending and later op with ``exc`` (call on the loop); ``waits``: the waits on the
        coordinator too (not while this rank's own abort is on its way there, see ``_abort_world``)."""
        if self._abort_exc is None:
            self._abort_exc = exc
            if not self._closed:
                log.error("%s", exc)
        self.aborted.set()
        self.plane.fail_all(self._abort_exc)
        # A rank waiting on the coordinator (barrier, KV wait) fails now too.
        if waits and self._coord is not None:
            self._coord.fail_waits(self._abort_exc)
        comms = [g.transports.nccl for g in self._groups.values() if g.transports.nccl is not None]
        if comms:
            # NCCL work queued on a stream waits for peers that may never come: abort every communicator
            # (off the loop: ncclCommAbort waits for NCCL's own threads).
            threading.Thread(
                target=lambda: [c.abort() for c in comms], name="nccl-abort", daemon=True
            ).start()

    def abort_world(self, exc: PlaneError) -> None:
        """Fail every op here with ``exc`` and abort the world on the coordinator, so every rank learns it
        (from any thread but the loop's; returns at once)."""
        if not self._closed:
            self.loop.submit(self._abort_world(exc))

    def cause_of_peer_lost(self, exc: PeerLost) -> PlaneError:
        """What to report for a peer a transport found dead: the world's abort if the coordinator has one, else
        what that peer said made it stop (its error frame), else ``exc``. A rank that aborts the world
        (``world.abort(reason)``) and exits may be seen dead here before the abort's notice arrives; the
        coordinator has it already (the abort call returned before the exit), so one heartbeat tells every rank
        the reason instead of a bare PeerLost. Likewise a rank that stopped because another rank died, and
        exited, is not the cause: the death it reported (to the coordinator or in its error frames) is. From
        any thread but the loop's.
        """
        if not self.aborted.is_set() and not self._closed and self._coord is not None:
            with contextlib.suppress(PlaneError, TimeoutError, asyncio.TimeoutError):
                self.run(self._beat(2.0), timeout=3.0)
        if self._abort_exc is not None:
            return self._abort_exc
        told = self.plane.told_by(exc.rank)
        if told is not None and not (isinstance(told, PeerLost) and told.rank == exc.rank):
            return told
        return exc

    async def _abort_world(self, exc: PlaneError) -> None:
        # This rank's waits on the coordinator end once the abort is there: ended first, the rank could go
        # on and leave before its abort arrived, and the others would learn only that it left.
        self._abort(exc, waits=False)
        try:
            with contextlib.suppress(PlaneError, asyncio.TimeoutError):
                await within(self.coord.abort(f"rank {self.rank}: {exc}"), 10)
        finally:
            if self._coord is not None:
                self._coord.fail_waits(self._abort_exc or exc)

    def _device_comm_error(self) -> DeviceCommError | None:
        """The first asynchronous error of this rank's NCCL communicators (NCCL reports them only when asked)."""
        if self.aborted.is_set():  # the communicators are being torn down; the cause is known
            return None
        for g in list(self._groups.values()):
            comm = g.transports.nccl
            error = comm.async_error() if comm is not None else None
            if error is not None:
                return error
        return None

    @property
    def coord(self) -> CoordinatorClient:
        if self._coord is None:
            raise PlaneClosed("the runtime has not joined a world")
        return self._coord

    @property
    def closed(self) -> bool:
        """Whether ``shutdown()`` was called."""
        return self._closed

    def abort_error(self) -> PlaneError:
        return self._abort_exc or PlaneClosed("the plane was shut down")

    def shutdown(self, grace: float = SHUTDOWN_GRACE_S) -> None:
        """Leave the world: finish outbound streams, stop serving, stop the loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for g in self._groups.values():
            g.close()
        if self.tracer is not None:
            self.tracer.close()
        try:
            self.loop.run(self._teardown(grace), timeout=grace + 10)
        finally:
            self.loop.stop()

    async def _teardown(self, grace: float = 1.0) -> None:
        self._closed = True
        # The heartbeats and the watch go on while the plane flushes: this rank is not lost meanwhile, and a
        # peer that leaves or is lost meanwhile is not waited for.
        await self.plane.told(min(grace, 3.0))  # errors this rank found reach its peers before its leaving
        # What this rank sent is delivered before it leaves: its peers, told it left, need not wait for more.
        await self.plane.flush(grace)
        for t in self._tasks:
            t.cancel()
        if self._coord is not None:
            if hasattr(self, "membership"):
                with contextlib.suppress(Exception):
                    await within(self.coord.leave(), grace)
            await self.coord.close()
        await self.plane.close(grace)
        if self._abort_exc is None:
            self._abort_exc = PlaneClosed("the plane was shut down: no collective can run after shutdown()")
        self.aborted.set()

    def use_gpu(self) -> int:
        """Make this rank's GPU (``local_rank`` modulo the visible devices) cupy's current device and return
        its id, with the NCCL environment of ranks that share a GPU set (``share_gpu_env``)."""
        from paramplane.node.arrays import cupy_module
        from paramplane.node.transports.nccl import share_gpu_env

        cupy = cupy_module()
        if cupy is None:
            raise RuntimeError("use_gpu needs cupy and a CUDA device: pip install 'paramplane[gpu]'")
        num_devices = int(cupy.cuda.runtime.getDeviceCount())
        share_gpu_env(self.topology, self.rank, num_devices)
        device = self.membership.local_rank % num_devices
        cupy.cuda.Device(device).use()
        return device

    # -- groups ----------------------------------------------------------------------------------
    def group(self, name: str, ranks: Sequence[int], timeout_s: float | None = None) -> GroupEngine:
        """The engine of group ``name`` over global ``ranks`` (this rank must be one of them)."""
        if name in self._groups:
            return self._groups[name]
        engine = GroupEngine(self, name, ranks, timeout_s or self.config.timeout_s)
        self._groups[name] = engine
        return engine

    def new_group(self, ranks: Sequence[int], timeout_s: float | None = None) -> GroupEngine:
        """A new group of global ``ranks``, named by its member set.

        Only the members call this. The k-th group of one member set gets the same name on every
        member, so members that create their groups in the same order agree without talking to
        ranks outside the group.
        """
        if timeout_s is not None:
            check_seconds(timeout_s, "a group's timeout")
        members = tuple(sorted(int(r) for r in ranks))
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} is not a member of the new group {list(members)}")
        k = self._num_groups_of.get(members, 0)
        self._num_groups_of[members] = k + 1
        return self.group(group_name(members, k), members, timeout_s)

    # -- synchronous coordinator helpers ---------------------------------------------------------
    def run(self, coro: Any, timeout: float | None = None) -> Any:
        if self._closed:
            coro.close()
            raise PlaneClosed("the plane was shut down")
        return self.loop.run(coro, timeout)
