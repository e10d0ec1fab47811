"""The coordinator's gRPC server (config, lifecycle, health, TLS) and a thread to embed it in."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from paramplane.coordinator.host_lane import HostLanes
from paramplane.coordinator.hosts import serialize_join
from paramplane.coordinator.http import HttpView
from paramplane.coordinator.service import CoordinatorService
from paramplane.coordinator.state import MAX_VALUE_BYTES, CoordinatorState
from paramplane.protos import coordinator_pb2_grpc as pb_grpc
from paramplane.protos.auth import TokenAuthInterceptor
from paramplane.protos.net import check_seconds, host_port, is_loopback

log = logging.getLogger("paramplane.coordinator")

SERVICE_NAME = "paramplane.v1.Coordinator"


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
    http_port: int | None = None
    """Serve the live view (``/`` page, ``/metrics``, ``/api/status``) on this TCP port; 0 picks a free one,
    None serves none."""
    http_host: str | None = None
    """Interface the live view binds (None: ``host``); anything but loopback needs a token."""
    host_lane_port: int | None = 0
    """TCP port (on ``host``) of the host lane: host agents' barriers and unique-id calls on plain TCP, without
    gRPC's threads; offered to each agent on its gRPC stream, which it keeps using when the lane is out of reach.
    0 picks a free one, None (``off``) serves none; never served with TLS (it is not encrypted)."""
    http_public: bool = False
    """Serve the live view without the token (it only reads); refused on an interface other than loopback
    when the job has no token."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.token is not None and not self.token:
            raise ValueError("token must be a non-empty string (or None)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        # Every check is written so that NaN fails it (a comparison with NaN is False).
        for name in ("join_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s"):
            check_seconds(getattr(self, name), name, upper=None)
        if not self.heartbeat_timeout_s > self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s})"
            )
        check_seconds(self.progress_timeout_s, "progress_timeout_s", allow_zero=True, upper=None)
        if self.max_message_bytes < MAX_VALUE_BYTES + 64 * 1024:
            raise ValueError(
                f"max_message_bytes must be at least {MAX_VALUE_BYTES + 64 * 1024} (the largest KV value)"
            )
        if not is_loopback(self.host) and not self.token:
            raise ValueError(f"refusing to bind {self.host} without a token; pass --token-file")
        if self.host_lane_port is not None and not 0 <= self.host_lane_port <= 65535:
            raise ValueError(f"host_lane_port must be in 0..65535 (or None), got {self.host_lane_port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in 0..65535 (or None), got {self.http_port}")
        if self.http_port is not None and not is_loopback(self.view_host) and not self.token:
            raise ValueError(
                f"refusing to serve the HTTP view on {self.view_host} without a token (even with --http-public): "
                "pass --token-file, or bind it to 127.0.0.1"
            )

    @property
    def view_host(self) -> str:
        """The interface the live view binds."""
        return self.http_host if self.http_host is not None else self.host


def _counted(counts: Counter[str], name: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` counting its calls in ``counts`` (``paramplane status``, the live view)."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        def count_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            counts[name] += 1
            return unary(request, context)

        return grpc.unary_unary_rpc_method_handler(count_unary, **kw)
    if handler.stream_stream is not None:  # HostCalls: each call on the stream is counted by the service
        both = handler.stream_stream

        async def count_both(requests: Any, context: grpc.aio.ServicerContext) -> None:
            counts[name] += 1  # a coroutine function: grpc then lets the handler write (context.write)
            await both(requests, context)

        return grpc.stream_stream_rpc_method_handler(count_both, **kw)
    stream = handler.unary_stream
    assert stream is not None  # the service has no client-streaming method

    def count_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        counts[name] += 1
        return stream(request, context)

    return grpc.unary_stream_rpc_method_handler(count_stream, **kw)


def add_servicer(service: pb_grpc.CoordinatorServicer, server: grpc.aio.Server, counts: Counter[str]) -> None:
    """The generated registration, with Join's response serializer taking the wire bytes Join answers and
    every call counted in ``counts`` (the coordinator and the host agent serve the same service)."""

    class _Capture:
        handlers: dict[str, grpc.RpcMethodHandler] = {}

        def add_generic_rpc_handlers(self, _handlers: object) -> None:
            pass

        def add_registered_method_handlers(
            self, _name: str, handlers: dict[str, grpc.RpcMethodHandler]
        ) -> None:
            self.handlers = handlers

    capture = _Capture()
    pb_grpc.add_CoordinatorServicer_to_server(service, capture)
    handlers = {name: _counted(counts, name, h) for name, h in capture.handlers.items()}
    for name in ("Join", "JoinHost"):
        join = handlers[name]
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            join.unary_unary,
            request_deserializer=join.request_deserializer,
            response_serializer=serialize_join,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


class CoordinatorServer:
    """A running coordinator; create it with ``await CoordinatorServer.start(config)``."""

    def __init__(
        self,
        config: CoordinatorConfig,
        server: grpc.aio.Server,
        port: int,
        service: CoordinatorService,
        health_servicer: health_aio.HealthServicer,
    ) -> None:
        self.config = config
        self._server = server
        self._port = port
        self._service = service
        self._health = health_servicer
        self._stopped = False
        self.view: HttpView | None = None
        self.lanes: HostLanes | None = None

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
        state = CoordinatorState(
            config.world_size,
            join_timeout_s=config.join_timeout_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            progress_timeout_s=config.progress_timeout_s,
        )
        service = CoordinatorService(
            state,
            heartbeat_interval_s=config.heartbeat_interval_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
        )
        add_servicer(service, server, service.num_calls)
        health_servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        target = host_port(config.host, config.port)
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
        if config.host_lane_port is not None and config.tls_cert is None:
            lanes = HostLanes(service.host_streams, config.token, config.max_message_bytes)
            try:
                await lanes.start(config.host, config.host_lane_port)
            except OSError:
                await self.stop(0)
                raise
            self.lanes, service.lane_port = lanes, lanes.port
        if config.http_port is not None:
            view = HttpView(service.status, token=config.token, public=config.http_public)
            try:
                await view.start(config.view_host, config.http_port)
            except OSError:
                await self.stop(0)
                raise
            self.view = view
            log.info("live view on http://%s/", view.address)
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
        return host_port(self.config.host, self._port)

    @property
    def http_address(self) -> str | None:
        """host:port of the live view (None when it is off)."""
        return self.view.address if self.view is not None else None

    async def stop(self, grace: float = 1.0) -> None:
        """Tell watchers SHUTDOWN, fail waiting calls, then stop serving within ``grace`` seconds."""
        if self._stopped:
            return
        self._stopped = True
        if self.view is not None:
            await self.view.stop()
        await self._health.enter_graceful_shutdown()
        self._service.shutdown()
        try:
            await self._server.stop(grace)
        finally:
            if self.lanes is not None:
                await self.lanes.stop()
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
        self.http_address: str | None = None
        """host:port of the live view once started (None when it is off)."""

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
        self.http_address = server.http_address
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
