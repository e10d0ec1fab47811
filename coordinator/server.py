"""The coordinator's gRPC server: servicers do I/O, every decision is CoordinatorState's."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio  # type: ignore[attr-defined]  # grpc-stubs lack it

from paramplane.coordinator.model import Assignment, Effects, ErrorKind, Event, EventKind, Joiner, StateError
from paramplane.coordinator.state import MAX_VALUE_BYTES, CoordinatorState
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos import coordinator_pb2_grpc as pb_grpc
from paramplane.protos.auth import TokenAuthInterceptor

log = logging.getLogger("paramplane.coordinator")

# Trailing metadata the client reads to type its errors (node/coord_client.py uses the same keys).
ABORT_RANK_METADATA_KEY = "x-paramplane-abort-rank"
MISMATCH_METADATA_KEY = "x-paramplane-mismatch"
SERVICE_NAME = "paramplane.v1.Coordinator"
# A blocking call that the state machine failed to answer this long after its own deadline is an internal error.
_BACKSTOP_S = 5.0
_T = TypeVar("_T")

_EVENT_KINDS = {
    EventKind.MEMBERSHIP: pb.WatchEvent.MEMBERSHIP,
    EventKind.ABORT: pb.WatchEvent.ABORT,
    EventKind.LEFT: pb.WatchEvent.LEFT,
    EventKind.SHUTDOWN: pb.WatchEvent.SHUTDOWN,
}


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (an IP literal, or "localhost")."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


@dataclass(kw_only=True)
class CoordinatorConfig:
    """Settings of one coordinator (one world)."""

    world_size: int
    """Number of ranks that form the world."""
    host: str = "127.0.0.1"
    """Interface to bind; anything but loopback needs a token."""
    port: int = 29400
    """TCP port to bind; 0 picks a free one (see ``CoordinatorServer.port``)."""
    token: str | None = field(default=None, repr=False)
    """Job token every call must carry; None admits every call (loopback only)."""
    tls_cert: bytes | None = field(default=None, repr=False)
    """PEM certificate chain for TLS; needs ``tls_key``."""
    tls_key: bytes | None = field(default=None, repr=False)
    """PEM private key for TLS; needs ``tls_cert``."""
    join_timeout_s: float = 300.0
    """How long joiners wait for the world, counted from the first waiting joiner."""
    heartbeat_interval_s: float = 1.0
    """How often ranks should heartbeat (told to them on join)."""
    heartbeat_timeout_s: float = 10.0
    """Silence after which a rank is declared dead and the world aborts."""
    progress_timeout_s: float = 300.0
    """How long a rank may lag behind its peers on a group without progress; 0 turns the watchdog off."""
    max_message_bytes: int = 16 * 1024 * 1024
    """Largest gRPC message sent or received."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.token is not None and not self.token:
            raise ValueError("token must be a non-empty string (or None)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        if self.join_timeout_s <= 0 or self.heartbeat_interval_s <= 0:
            raise ValueError("join_timeout_s and heartbeat_interval_s must be > 0")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s})"
            )
        if self.progress_timeout_s < 0:
            raise ValueError(f"progress_timeout_s must be >= 0 (0 = off), got {self.progress_timeout_s}")
        if self.max_message_bytes < MAX_VALUE_BYTES + 64 * 1024:
            raise ValueError(
                f"max_message_bytes must be at least {MAX_VALUE_BYTES + 64 * 1024} (the largest KV value)"
            )
        if not is_loopback(self.host) and not self.token:
            raise ValueError(f"refusing to bind {self.host} without a token; pass --token-file")


def _assignment_pb(a: Assignment, config: CoordinatorConfig) -> pb.JoinResponse:
    return pb.JoinResponse(
        rank=a.rank,
        world_size=a.world_size,
        node_rank=a.node_rank,
        num_nodes=a.num_nodes,
        local_rank=a.local_rank,
        local_world_size=a.local_world_size,
        epoch=a.epoch,
        peers=[
            pb.PeerInfo(
                rank=p.rank,
                address=p.address,
                host_id=p.host_id,
                node_rank=p.node_rank,
                local_rank=p.local_rank,
            )
            for p in a.peers
        ],
        heartbeat_interval_s=config.heartbeat_interval_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        job_id=a.job_id,
    )


class _CoordinatorService(pb_grpc.CoordinatorServicer):
    """The servicer: turns requests into state calls and state effects into answers and events."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self._config = config
        self._state = CoordinatorState(
            config.world_size,
            join_timeout_s=config.join_timeout_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            progress_timeout_s=config.progress_timeout_s,
        )
        self._waiters: dict[int, asyncio.Future[object]] = {}
        self._ids = itertools.count()
        self._watchers: set[asyncio.Queue[Event]] = set()
        self._wake = asyncio.Event()
        self._ticker: asyncio.Task[None] | None = None

    # -- effects ----------------------------------------------------------------------------------
    def _flush(self) -> None:
        effects: Effects = self._state.take_effects()
        for res in effects.resolved:
            fut = self._waiters.get(res.waiter)
            if fut is None or fut.done():
                continue
            if res.error is not None:
                fut.set_exception(res.error)
            else:
                fut.set_result(res.value)
        if effects.formed:
            hosts = sorted({p.host_id for p in effects.formed[0].peers})
            log.info(
                "world formed: %d ranks on %d hosts %s, job %s",
                len(effects.formed),
                len(hosts),
                hosts,
                effects.formed[0].job_id,
            )
        for event in effects.events:
            if event.kind is EventKind.ABORT:
                log.error("world aborted: %s", event.reason)
            else:
                log.info("%s", event.reason)
            for queue in self._watchers:
                queue.put_nowait(event)

    async def _block(self, register: Callable[[int], None], limit_s: float) -> object:
        """Register a waiter with the state and wait for its resolution (or withdraw it if the caller leaves)."""
        waiter = next(self._ids)
        fut: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._waiters[waiter] = fut
        try:
            register(waiter)
            self._flush()
            self._wake.set()  # the ticker recomputes its next deadline
            return await asyncio.wait_for(fut, limit_s + _BACKSTOP_S)
        except asyncio.TimeoutError:
            raise StateError(
                ErrorKind.DEADLINE_EXCEEDED, "the coordinator missed its own deadline (internal error)"
            ) from None
        finally:
            del self._waiters[waiter]
            if not fut.done() or fut.cancelled():
                self._state.cancel(waiter)
                self._flush()

    async def _guard(self, context: grpc.aio.ServicerContext, work: Awaitable[_T]) -> _T:
        try:
            return await work
        except StateError as e:
            trailers: tuple[tuple[str, str], ...] = ()
            if e.kind is ErrorKind.ABORTED:
                trailers = ((ABORT_RANK_METADATA_KEY, str(e.rank)),)
            elif e.mismatch:
                trailers = ((MISMATCH_METADATA_KEY, "1"),)
            await context.abort(grpc.StatusCode[e.kind.name], str(e), trailing_metadata=trailers)
            raise  # context.abort raised already

    async def _sync(self, fn: Callable[[], _T]) -> _T:
        result = fn()
        self._flush()
        return result

    # -- ticker -----------------------------------------------------------------------------------
    def start_ticker(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(
            self._tick_forever(), name="paramplane-coordinator-tick"
        )

    async def stop_ticker(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    async def _tick_forever(self) -> None:
        period = self._config.heartbeat_interval_s / 4
        while True:
            now = time.monotonic()
            try:
                self._state.tick(now)
                self._flush()
            except Exception:
                log.exception("coordinator tick failed")
            deadline = self._state.next_deadline()
            delay = period if deadline is None else min(period, max(0.0, deadline - now))
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    def shutdown(self) -> None:
        self._state.shutdown()
        self._flush()

    # -- RPCs -------------------------------------------------------------------------------------
    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinResponse:
        joiner = Joiner(
            instance_id=request.instance_id,
            host_id=request.host_id,
            peer_address=request.peer_address,
            rank_hint=request.rank_hint,
            world_size=request.world_size,
            pid=request.pid,
        )
        log.info("join: host %s pid %d rank hint %d", joiner.host_id, joiner.pid, joiner.rank_hint)
        work = self._block(
            lambda w: self._state.join(joiner, w, time.monotonic()), self._config.join_timeout_s
        )
        assignment = await self._guard(context, work)
        assert isinstance(assignment, Assignment)
        return _assignment_pb(assignment, self._config)

    async def KVSet(self, request: pb.KVSetRequest, context: grpc.aio.ServicerContext) -> pb.KVSetResponse:
        await self._guard(
            context, self._sync(lambda: self._state.kv_set(request.epoch, request.key, request.value))
        )
        return pb.KVSetResponse()

    async def KVGet(self, request: pb.KVGetRequest, context: grpc.aio.ServicerContext) -> pb.KVGetResponse:
        if not request.wait:
            value = await self._guard(
                context, self._sync(lambda: self._state.kv_get(request.epoch, request.key))
            )
            return pb.KVGetResponse(found=value is not None, value=value or b"")
        work = self._block(
            lambda w: self._state.kv_wait(request.epoch, request.key, request.timeout_s, w, time.monotonic()),
            request.timeout_s,
        )
        found = await self._guard(context, work)
        assert isinstance(found, bytes)
        return pb.KVGetResponse(found=True, value=found)

    async def KVAdd(self, request: pb.KVAddRequest, context: grpc.aio.ServicerContext) -> pb.KVAddResponse:
        value = await self._guard(
            context, self._sync(lambda: self._state.kv_add(request.epoch, request.key, request.delta))
        )
        return pb.KVAddResponse(value=value)

    async def KVCompareSet(
        self, request: pb.KVCompareSetRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVCompareSetResponse:
        expected = None if request.expect_absent else request.expected
        swapped, current = await self._guard(
            context,
            self._sync(
                lambda: self._state.kv_compare_set(request.epoch, request.key, expected, request.desired)
            ),
        )
        return pb.KVCompareSetResponse(swapped=swapped, present=current is not None, current=current or b"")

    async def KVDelete(
        self, request: pb.KVDeleteRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVDeleteResponse:
        deleted = await self._guard(
            context, self._sync(lambda: self._state.kv_delete(request.epoch, request.key))
        )
        return pb.KVDeleteResponse(deleted=deleted)

    async def Barrier(
        self, request: pb.BarrierRequest, context: grpc.aio.ServicerContext
    ) -> pb.BarrierResponse:
        def register(waiter: int) -> None:
            self._state.barrier(
                request.epoch,
                request.name,
                request.rank,
                list(request.ranks),
                request.timeout_s,
                waiter,
                time.monotonic(),
            )

        await self._guard(context, self._block(register, request.timeout_s))
        return pb.BarrierResponse()

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        progress = {p.group: (p.issued, p.completed) for p in request.progress}
        aborted, reason = await self._guard(
            context,
            self._sync(
                lambda: self._state.heartbeat(request.epoch, request.rank, progress, time.monotonic())
            ),
        )
        return pb.HeartbeatResponse(aborted=aborted, reason=reason)

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEvent]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            pending = await self._guard(
                context, self._sync(lambda: self._state.snapshot_events(request.epoch, request.rank))
            )
            while True:
                event = pending.pop(0) if pending else await queue.get()
                yield pb.WatchEvent(
                    kind=_EVENT_KINDS[event.kind], epoch=event.epoch, rank=event.rank, reason=event.reason
                )
                if event.kind in (EventKind.ABORT, EventKind.SHUTDOWN):
                    return
        finally:
            self._watchers.discard(queue)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._guard(
            context, self._sync(lambda: self._state.abort(request.epoch, request.rank, request.reason))
        )
        return pb.AbortResponse()

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        await self._guard(context, self._sync(lambda: self._state.leave(request.epoch, request.rank)))
        return pb.LeaveResponse()


class CoordinatorServer:
    """A running coordinator; create it with ``await CoordinatorServer.start(config)``."""

    def __init__(
        self,
        config: CoordinatorConfig,
        server: grpc.aio.Server,
        port: int,
        service: _CoordinatorService,
        health_servicer: health_aio.HealthServicer,
    ) -> None:
        self.config = config
        self._server = server
        self._port = port
        self._service = service
        self._health = health_servicer
        self._stopped = False

    @classmethod
    async def start(cls, config: CoordinatorConfig) -> CoordinatorServer:
        """Bind, start serving and report SERVING on the health service."""
        options = [
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            # Two coordinators on one port would split the world between them: fail the second bind.
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.aio.server(interceptors=[TokenAuthInterceptor(config.token)], options=options)
        service = _CoordinatorService(config)
        pb_grpc.add_CoordinatorServicer_to_server(service, server)
        health_servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        target = _host_port(config.host, config.port)
        try:
            if config.tls_cert is not None and config.tls_key is not None:
                port = server.add_secure_port(
                    target, grpc.ssl_server_credentials([(config.tls_key, config.tls_cert)])
                )
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as e:
            raise OSError(f"cannot bind the coordinator to {target}: is the port in use? ({e})") from e
        if port == 0:
            raise OSError(f"cannot bind the coordinator to {target}: is the port in use?")
        await server.start()
        service.start_ticker()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self = cls(config, server, port, service, health_servicer)
        log.info(
            "coordinator listening on %s (world size %d%s)",
            self.address,
            config.world_size,
            ", TLS" if config.tls_cert else "",
        )
        return self

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        """host:port to give to ranks (PARAMPLANE_COORDINATOR)."""
        return _host_port(self.config.host, self._port)

    async def stop(self, grace: float = 1.0) -> None:
        """Tell watchers SHUTDOWN, fail waiting calls, then stop serving within ``grace`` seconds."""
        if self._stopped:
            return
        self._stopped = True
        await self._health.enter_graceful_shutdown()
        self._service.shutdown()
        try:
            await self._server.stop(grace)
        finally:
            await self._service.stop_ticker()
        log.info("coordinator stopped")

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


class CoordinatorThread:
    """A CoordinatorServer on its own event loop in a daemon thread (launcher ``--standalone``, tests)."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested: asyncio.Event | None = None
        self._grace = 1.0
        self._address = ""

    @property
    def address(self) -> str:
        return self._address

    def start(self, timeout_s: float = 30.0) -> str:
        """Start serving; answers "host:port" once listening and raises what startup raised."""
        if self._thread is not None:
            raise RuntimeError("this CoordinatorThread was started already")
        self._thread = threading.Thread(
            target=asyncio.run, args=(self._main(),), name="paramplane-coordinator", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the coordinator did not start within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._address

    async def _main(self) -> None:
        try:
            server = await CoordinatorServer.start(self.config)
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        self._address = server.address
        self._ready.set()
        try:
            await self._stop_requested.wait()
        finally:
            await server.stop(self._grace)

    def stop(self, grace: float = 1.0, timeout_s: float = 10.0) -> None:
        """Stop the server (``grace`` for in-flight calls) and join the thread."""
        thread, loop, stop = self._thread, self._loop, self._stop_requested
        if thread is None or not thread.is_alive() or loop is None or stop is None:
            return
        self._grace = grace
        loop.call_soon_threadsafe(stop.set)
        thread.join(grace + timeout_s)
        if thread.is_alive():
            log.warning("the coordinator thread did not stop within %.1f s", grace + timeout_s)

    def __enter__(self) -> CoordinatorThread:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
