"""The node runtime's link to the coordinator: an asyncio gRPC client with typed errors.

Every call has a deadline and carries the job token; gRPC failures become
``paramplane.PlaneError`` subclasses in one place (``_plane_error``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc

from paramplane.coordinator.model import RankStats
from paramplane.node.coord_lane import RankLane
from paramplane.node.errors import (
    AuthError,
    CollectiveMismatch,
    CollectiveTimeout,
    CoordinatorUnavailable,
    PeerLost,
    PlaneClosed,
    PlaneError,
    RendezvousError,
    TransportError,
    WorldAborted,
)
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos import coordinator_pb2_grpc as pb_grpc
from paramplane.protos.auth import (
    ABORT_RANK_METADATA_KEY,
    LEFT_RANK_METADATA_KEY,
    MISMATCH_METADATA_KEY,
    token_metadata,
)
from paramplane.protos.net import best_effort, check_seconds, parse_address, tls_paths
from paramplane.protos.records import RankInfo
from paramplane.protos.stats import stats_pb

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# Trailing metadata set by the coordinator (coordinator/server.py uses the same keys).
# Extra time a blocking call gets beyond its own wait, so that the server's answer arrives first.
WAIT_MARGIN_S = 5.0
_JOIN_BACKOFF_S = (0.05, 1.0)
T = TypeVar("T")
_KINDS = {
    pb.WatchEvent.MEMBERSHIP: "membership",
    pb.WatchEvent.ABORT: "abort",
    pb.WatchEvent.LEFT: "left",
    pb.WatchEvent.SHUTDOWN: "shutdown",
}


@dataclass(frozen=True)
class Membership:
    """This rank's place in the world, as the coordinator assigned it."""

    rank: int
    world_size: int
    node_rank: int
    num_nodes: int
    local_rank: int
    local_world_size: int
    epoch: int
    peers: tuple[RankInfo, ...]
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    job_id: str


@dataclass(frozen=True)
class WatchEventInfo:
    kind: str  # "membership" | "abort" | "left" | "shutdown"
    rank: int
    reason: str
    epoch: int
    lost: bool = False
    """For "abort": the named rank is gone or stuck (not a rank that chose to abort)."""


def _plane_error(e: grpc.aio.AioRpcError, address: str, call: str) -> PlaneError | ValueError:
    """The typed error for a failed coordinator call (``call`` is "join", "barrier", "kv_wait" or another name)."""
    code, details = e.code(), e.details() or ""
    # grpc.aio hands (key, value) pairs; grpc-stubs type them otherwise.
    pairs = cast("Iterable[tuple[str, str | bytes]]", e.trailing_metadata() or ())
    trailers = {key: str(value) for key, value in pairs}
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(f"the coordinator at {address} refused the call: {details}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return CoordinatorUnavailable(
            f"cannot reach the coordinator at {address}: is it running? check PARAMPLANE_COORDINATOR ({details})"
        )
    if code == grpc.StatusCode.ABORTED:
        return WorldAborted(details, rank=int(trailers.get(ABORT_RANK_METADATA_KEY, -1)))
    if call == "join":
        return RendezvousError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return CollectiveTimeout(f"coordinator call {call} timed out: {details}")
    if trailers.get(MISMATCH_METADATA_KEY):
        return CollectiveMismatch(details)
    if LEFT_RANK_METADATA_KEY in trailers:
        return PeerLost(details, int(trailers[LEFT_RANK_METADATA_KEY]))
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return RendezvousError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return TransportError(f"coordinator call {call}: message too large ({details})")
    if code == grpc.StatusCode.CANCELLED:
        return PlaneClosed(f"coordinator call {call} was cancelled: the client is closing ({details})")
    return PlaneError(f"coordinator call {call} failed with {code.name}: {details}")


def _check_timeout(timeout_s: float) -> float:
    return check_seconds(timeout_s, "timeout_s")


def ask_coordinator(
    address: str, token: str | None, call: Callable[[CoordinatorClient], Awaitable[T]], *, timeout_s: float
) -> T:
    """``call(client)`` from synchronous code (the launcher, ``paramplane status``): a client of ``address``
    with ``timeout_s`` as every call's deadline, TLS when ``PARAMPLANE_TLS_CA`` names the coordinator's root
    certificate, closed afterwards. Errors are the client's typed ones (``PlaneError`` subclasses)."""
    ca = tls_paths()["CA"]
    root = Path(ca).read_bytes() if ca else None

    async def run() -> T:
        async with CoordinatorClient(address, token=token, tls_root_cert=root, call_timeout_s=timeout_s) as c:
            return await call(c)

    return asyncio.run(run())


class CoordinatorClient:
    """Async client of one coordinator; create and use it inside one running event loop."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls_root_cert: bytes | None = None,
        call_timeout_s: float = 30.0,
    ) -> None:
        if not address.startswith("unix:"):  # unix:PATH: the host agent (node/host_agent.py)
            parse_address(address, "coordinator address")
        self.address = address
        self._timeout_s = _check_timeout(call_timeout_s)
        self._metadata = token_metadata(token)
        self._token = token
        # Calling a host agent (unix:PATH): its rank lane, if it serves one beside (client/agent_lane.py).
        self._lane_path = (
            str(Path(address[5:]).with_name("lane.sock")) if address.startswith("unix:") else None
        )
        self._lane: RankLane | None = None
        self._lane_host = (
            None if tls_root_cert is not None or address.startswith("unix:") else parse_address(address)[0]
        )
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # Ranks may start before the coordinator: keep reconnect attempts frequent.
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if tls_root_cert is not None and not address.startswith("unix:"):  # a local socket needs no TLS
            creds = grpc.ssl_channel_credentials(root_certificates=tls_root_cert)
            self._channel = grpc.aio.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self.membership: Membership | None = None
        self._failure: PlaneError | None = None
        self._waits: set[asyncio.Future[None]] = set()

    def fail_waits(self, exc: PlaneError) -> None:
        """End every pending and later wait on the coordinator (barrier, ``kv_get(wait=True)``) with ``exc`` at
        once instead of at its own deadline: the rank's runtime calls this when the world ends (abort, lost peer,
        a coordinator that stopped answering heartbeats). Other calls (abort, leave, ...) still go out. On the
        loop."""
        if self._failure is None:
            self._failure = exc
        for fut in self._waits:
            if not fut.done():
                fut.set_result(None)

    async def _wait(self, work: Coroutine[Any, Any, T]) -> T:
        """A call that waits on other ranks (``_call`` or ``_lane_call``), raced against ``fail_waits``."""
        if self._failure is not None:
            work.close()
            raise self._failure
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waits.add(failed)
        task = asyncio.ensure_future(work)
        try:
            await asyncio.wait((task, failed), return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            assert self._failure is not None
            raise self._failure
        finally:
            self._waits.discard(failed)
            failed.cancel()
            if not task.done():
                task.cancel()
                await best_effort(task, None)

    def _member(self) -> Membership:
        if self.membership is None:
            raise RendezvousError("not joined: call join() before any other coordinator call")
        return self.membership

    async def _call(
        self,
        call: str,
        method: grpc.aio.UnaryUnaryMultiCallable,
        request: object,
        timeout_s: float | None = None,
        *,
        wait_for_ready: bool = False,
    ) -> object:
        try:
            return await method(
                request,
                timeout=timeout_s or self._timeout_s,
                metadata=self._metadata,
                wait_for_ready=wait_for_ready,
            )
        except grpc.aio.AioRpcError as e:
            raise _plane_error(e, self.address, call) from None

    def _use_lane(self) -> RankLane | None:
        """The host agent's rank lane, when this client calls an agent that serves one (``lane.sock``)."""
        if self._lane is None and self._lane_path is not None and os.path.exists(self._lane_path):
            self._lane = RankLane(self._lane_path, self._token, MAX_MESSAGE_BYTES)
        return self._lane

    async def _lane_call(
        self, lane: RankLane, call: str, message: pb.HostCall, timeout_s: float
    ) -> pb.HostAnswer:
        try:
            return await lane.call(message, timeout_s)
        except grpc.aio.AioRpcError as e:
            raise _plane_error(e, self.address, call) from None

    async def join(
        self,
        *,
        host_id: str,
        peer_address: str,
        instance_id: str,
        rank_hint: int = -1,
        world_size: int = 0,
        timeout_s: float,
        replacement: bool = False,
    ) -> Membership:
        """Wait until the world forms; retries while the coordinator is not up yet, until ``timeout_s``.

        A ``replacement`` rank also retries while the current world is full: it waits for that world to
        end (its survivors call ``World.reform()``) and joins the next epoch.
        """
        _check_timeout(timeout_s)
        request = pb.JoinRequest(
            host_id=host_id,
            peer_address=peer_address,
            rank_hint=rank_hint,
            world_size=world_size,
            instance_id=instance_id,
            pid=os.getpid(),
        )
        deadline = time.monotonic() + timeout_s
        backoff = _JOIN_BACKOFF_S[0]
        while True:
            try:
                response = await self._stub.Join(
                    request, timeout=max(deadline - time.monotonic(), 0.001), metadata=self._metadata
                )
                break
            except grpc.aio.AioRpcError as e:
                left = deadline - time.monotonic()
                retry = e.code() == grpc.StatusCode.UNAVAILABLE or (
                    replacement and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                )
                if retry and left > 0:
                    await asyncio.sleep(min(backoff, left))
                    backoff = min(backoff * 2, _JOIN_BACKOFF_S[1])
                    continue
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and left <= 0:
                    if self._channel.get_state() != grpc.ChannelConnectivity.READY:
                        # The last attempt ran out of time still connecting: nothing was ever reached.
                        raise CoordinatorUnavailable(
                            f"cannot reach the coordinator at {self.address}: is it running? nothing answered within "
                            f"this rank's join timeout of {timeout_s:.1f} s; check PARAMPLANE_COORDINATOR"
                        ) from None
                    raise RendezvousError(
                        f"the world did not form within this rank's join timeout of {timeout_s:.1f} s: check that "
                        f"every rank was started and points at the coordinator {self.address} ({e.details()})"
                    ) from None
                raise _plane_error(e, self.address, "join") from None
        assert isinstance(response, pb.JoinResponse)
        self.membership = Membership(
            rank=response.rank,
            world_size=response.world_size,
            node_rank=response.node_rank,
            num_nodes=response.num_nodes,
            local_rank=response.local_rank,
            local_world_size=response.local_world_size,
            epoch=response.epoch,
            peers=tuple(RankInfo.from_message(p) for p in response.peers),
            heartbeat_interval_s=response.heartbeat_interval_s,
            heartbeat_timeout_s=response.heartbeat_timeout_s,
            job_id=response.job_id,
        )
        if (lane := self._use_lane()) is not None:
            lane.open_soon()  # the first barrier after the join does not wait for the lane to open
        return self.membership

    async def kv_set(self, key: str, value: bytes) -> None:
        request = pb.KVSetRequest(epoch=self._member().epoch, key=key, value=value)
        if (lane := self._use_lane()) is not None:
            await self._lane_call(lane, "kv_set", pb.HostCall(kv_set=request), self._timeout_s)
            return
        await self._call("kv_set", self._stub.KVSet, request)

    async def kv_get(self, key: str, *, wait: bool = False, timeout_s: float | None = None) -> bytes | None:
        """The value of ``key`` (None if absent); with ``wait``, block until it is set (CollectiveTimeout after timeout_s)."""
        wait_s = _check_timeout(self._timeout_s if timeout_s is None else timeout_s) if wait else 0.0
        request = pb.KVGetRequest(epoch=self._member().epoch, key=key, wait=wait, timeout_s=wait_s)
        response: object
        if wait and (lane := self._use_lane()) is not None:
            call = self._lane_call(lane, "kv_wait", pb.HostCall(kv_get=request), wait_s + WAIT_MARGIN_S)
            response = (await self._wait(call)).value
        elif wait:
            response = await self._wait(
                self._call("kv_wait", self._stub.KVGet, request, wait_s + WAIT_MARGIN_S)
            )
        else:
            response = await self._call("kv_get", self._stub.KVGet, request)
        assert isinstance(response, pb.KVGetResponse)
        return response.value if response.found else None

    async def kv_add(self, key: str, delta: int = 1) -> int:
        """Atomically add ``delta`` to the integer at ``key`` (absent = 0); answers the new value."""
        response = await self._call(
            "kv_add", self._stub.KVAdd, pb.KVAddRequest(epoch=self._member().epoch, key=key, delta=delta)
        )
        assert isinstance(response, pb.KVAddResponse)
        return response.value

    async def kv_compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        """Set ``key`` to ``desired`` if it holds ``expected`` (None: absent); answers (swapped, value now)."""
        request = pb.KVCompareSetRequest(
            epoch=self._member().epoch,
            key=key,
            expect_absent=expected is None,
            expected=expected or b"",
            desired=desired,
        )
        response = await self._call("kv_compare_set", self._stub.KVCompareSet, request)
        assert isinstance(response, pb.KVCompareSetResponse)
        return response.swapped, response.current if response.present else None

    async def kv_delete(self, key: str) -> bool:
        response = await self._call(
            "kv_delete", self._stub.KVDelete, pb.KVDeleteRequest(epoch=self._member().epoch, key=key)
        )
        assert isinstance(response, pb.KVDeleteResponse)
        return response.deleted

    async def barrier(self, name: str, *, ranks: Sequence[int] | None = None, timeout_s: float) -> None:
        """Wait until every rank of ``ranks`` (default: the world) reached barrier ``name``."""
        m = self._member()
        request = pb.BarrierRequest(
            epoch=m.epoch,
            name=name,
            rank=m.rank,
            ranks=list(ranks or ()),
            timeout_s=_check_timeout(timeout_s),
        )
        if (lane := self._use_lane()) is not None:
            arrival = pb.BarrierHostRequest(
                epoch=m.epoch, name=name, arriving=[m.rank], ranks=request.ranks, timeout_s=request.timeout_s
            )
            message = pb.HostCall(barrier=arrival)
            await self._wait(self._lane_call(lane, "barrier", message, timeout_s + WAIT_MARGIN_S))
            return
        await self._wait(self._call("barrier", self._stub.Barrier, request, timeout_s + WAIT_MARGIN_S))

    async def heartbeat(
        self, progress: Mapping[str, tuple[int, int]], stats: RankStats | None = None
    ) -> WatchEventInfo | None:
        """Report liveness, (issued, completed) per group and this rank's counters; answers the world's abort
        (as the watch stream tells it) or None."""
        m = self._member()
        request = pb.HeartbeatRequest(
            epoch=m.epoch,
            rank=m.rank,
            progress=[pb.GroupProgress(group=g, issued=i, completed=c) for g, (i, c) in progress.items()],
            stats=stats_pb(stats) if stats is not None else None,
        )
        response = await self._call("heartbeat", self._stub.Heartbeat, request)
        assert isinstance(response, pb.HeartbeatResponse)
        if not response.aborted:
            return None
        return WatchEventInfo("abort", response.rank, response.reason, m.epoch, response.lost)

    async def watch(self) -> AsyncGenerator[WatchEventInfo, None]:
        """Membership first, then abort / left / shutdown events until the stream ends.

        The stream is long-lived and has no deadline; it ends after an abort or shutdown
        event, and a lost coordinator raises CoordinatorUnavailable.
        """
        m = self._member()
        stream = self._stub.Watch(pb.WatchRequest(epoch=m.epoch, rank=m.rank), metadata=self._metadata)
        try:
            async for event in stream:
                yield WatchEventInfo(
                    _KINDS.get(event.kind, "unknown"), event.rank, event.reason, event.epoch, event.lost
                )
        except grpc.aio.AioRpcError as e:
            raise _plane_error(e, self.address, "watch") from None
        finally:
            stream.cancel()

    async def abort(self, reason: str) -> None:
        """Abort the world, naming this rank and ``reason``; every rank is told."""
        m = self._member()
        await self.abort_epoch(m.epoch, m.rank, reason)

    async def abort_epoch(self, epoch: int, rank: int, reason: str) -> None:
        """Abort epoch ``epoch`` in the name of ``rank`` without having joined: the launcher does this for a
        rank it started (``status()`` tells the epoch and which ranks are whose)."""
        await self._call("abort", self._stub.Abort, pb.AbortRequest(epoch=epoch, rank=rank, reason=reason))

    async def status(
        self, *, timeout_s: float | None = None, wait_for_ready: bool = False
    ) -> pb.StatusResponse:
        """The world as the coordinator sees it (``paramplane status``); needs no join. With ``wait_for_ready``
        the call waits (up to its deadline) for a coordinator that is not reachable yet."""
        response = await self._call(
            "status", self._stub.Status, pb.StatusRequest(), timeout_s, wait_for_ready=wait_for_ready
        )
        assert isinstance(response, pb.StatusResponse)
        return response

    async def leave(self) -> None:
        """Leave cleanly: this rank's silence from now on is not a death."""
        m = self._member()
        await self._call("leave", self._stub.Leave, pb.LeaveRequest(epoch=m.epoch, rank=m.rank))

    # -- host calls: a host agent speaks for its ranks (node/host_agent.py) -------------------------------------
    # These raise the coordinator's grpc.aio.AioRpcError untouched: the agent relays each error to the rank
    # whose call it was, with its status code and trailers, and the rank's own client types it.
    async def join_host(self, joiners: Sequence[pb.JoinRequest], *, timeout_s: float) -> pb.JoinHostResponse:
        """Join several ranks at once; retries while the coordinator is not up yet, until ``timeout_s``."""
        deadline = time.monotonic() + _check_timeout(timeout_s)
        backoff = _JOIN_BACKOFF_S[0]
        request = pb.JoinHostRequest(joiners=joiners)
        while True:
            try:
                response = await self._stub.JoinHost(
                    request, timeout=max(deadline - time.monotonic(), 0.001), metadata=self._metadata
                )
                assert isinstance(response, pb.JoinHostResponse)
                return response
            except grpc.aio.AioRpcError as e:
                left = deadline - time.monotonic()
                if e.code() != grpc.StatusCode.UNAVAILABLE or left <= 0:
                    raise
                await asyncio.sleep(min(backoff, left))
                backoff = min(backoff * 2, _JOIN_BACKOFF_S[1])

    async def heartbeat_host(
        self, host_id: str, beats: Sequence[pb.HeartbeatRequest]
    ) -> pb.HeartbeatHostResponse:
        """The latest heartbeat of each of the host's ranks, in one call; answers one result per beat."""
        response = await self._stub.HeartbeatHost(
            pb.HeartbeatHostRequest(host_id=host_id, beats=beats),
            timeout=self._timeout_s,
            metadata=self._metadata,
        )
        assert isinstance(response, pb.HeartbeatHostResponse)
        return response

    async def barrier_host(self, request: pb.BarrierHostRequest) -> pb.BarrierHostResponse:
        """Several of the host's ranks arrive at one barrier; answers one outcome per arriving rank."""
        response = await self._stub.BarrierHost(
            request, timeout=request.timeout_s + WAIT_MARGIN_S, metadata=self._metadata
        )
        assert isinstance(response, pb.BarrierHostResponse)
        return response

    async def relay(self, method: str, request: object, *, timeout_s: float) -> object:
        """One call of ``method`` (a Coordinator RPC name) as a rank sent it, relayed by its host agent."""
        return await getattr(self._stub, method)(request, timeout=timeout_s, metadata=self._metadata)

    def host_calls(self) -> grpc.aio.StreamStreamCall:
        """A new ``HostCalls`` stream (the host agent's barriers, sets and waiting gets). Long-lived like a watch
        stream, so without a deadline: the agent times out each call on it."""
        return self._stub.HostCalls(metadata=self._metadata)

    def lane_hello(self, session: str) -> tuple[str, pb.HostLaneHello] | None:
        """The host to open a host lane on (the coordinator's own) and its first frame; None where no lane is
        used (TLS: the lane is not encrypted; a local socket)."""
        if self._lane_host is None:
            return None
        return self._lane_host, pb.HostLaneHello(token=self._token or "", session=session)

    def watch_as(self, epoch: int, rank: int) -> grpc.aio.UnaryStreamCall:
        """The Watch stream of ``epoch`` subscribed as ``rank``: the host agent holds one for its ranks."""
        return self._stub.Watch(pb.WatchRequest(epoch=epoch, rank=rank), metadata=self._metadata)

    async def close(self) -> None:
        if self._lane is not None:
            self._lane.close()
        await self._channel.close(None)

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
