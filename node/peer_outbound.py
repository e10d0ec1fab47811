"""The outbound half of the peer plane: this rank's links to its peers.

One link per (peer, stream key): a lane (``lane.py``: a raw Unix or TCP socket whose port the peer's gRPC
``Hello`` names) by default, a long-lived gRPC client stream of raw bytes under TLS or with
``PARAMPLANE_TCP_LANE=0``. Links open on first use and close with a goodbye at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from paramplane.node.errors import AuthError, PeerLost, PlaneClosed, PlaneError, TransportError
from paramplane.node.failures import KINDS, decode_failure
from paramplane.node.lane import HANDSHAKE_TIMEOUT_S, LaneStream
from paramplane.node.peer_wire import (
    CHANNEL_OPTIONS,
    CONFIGURE_WAIT_S,
    GOODBYE_KEY,
    HELLO_METHOD,
    HELLO_TLS_S,
    PUSH_METHOD,
    PlaneIdentity,
    TlsConfig,
    consume_exception,
)
from paramplane.protos import peer_pb2
from paramplane.protos.auth import token_metadata
from paramplane.protos.net import best_effort, parse_address, within

log = logging.getLogger(__name__)


class OutStream:
    """One outbound gRPC stream to a peer.

    ``send_frame`` writes a header and its chunks under a lock; a frame cut short by a write
    error leaves the stream ``broken`` (its receiver would misread what follows), so nothing
    more is written on it.
    """

    def __init__(self, call: Any, dst: int) -> None:
        self.call = call
        self.dst = dst
        self.lock = asyncio.Lock()
        self.broken = False
        self.opened: asyncio.Future[None] | None = None

    async def write(self, data: Any) -> None:
        try:
            await self.call.write(data if isinstance(data, bytes) else bytes(data))
        except Exception as exc:
            self.broken = True
            raise await self._failure(exc) from None

    async def send_frame(self, messages: Any) -> None:
        """Write every message of one frame (an iterable of bytes).

        The writing runs in a task of its own that the caller's cancellation does not reach:
        cancelling a grpc-aio write would end the whole stream, which its receiver could not
        tell from a dead sender. A frame is thus always written whole (or the stream broke).
        """
        assert self.opened is not None
        if not self.opened.done():
            await asyncio.shield(self.opened)
        task = asyncio.ensure_future(self._write_frame(messages))
        task.add_done_callback(consume_exception)
        await asyncio.shield(task)

    async def _write_frame(self, messages: Any) -> None:
        async with self.lock:
            if self.broken:
                raise TransportError(f"the stream to rank {self.dst} broke earlier; this group has failed")
            done = False
            try:
                for message in messages:
                    await self.write(message)
                done = True
            finally:
                if not done:
                    self.broken = True

    async def _failure(self, exc: BaseException) -> PlaneError:
        # A write fails before the call's status arrives; the status says why (a receiver that
        # aborted the stream names the group's failure), so wait for it briefly.
        details = (await best_effort(self.call.details(), 1.0)) or ""
        if details.split(": ", 1)[0].split("[", 1)[0] in KINDS:
            return decode_failure(details)
        return PeerLost(f"rank {self.dst} is unreachable: the data stream to it broke ({exc!r})", self.dst)


class Outbound:
    """The links from this rank to its peers, opened on first use."""

    def __init__(
        self,
        *,
        token: str | None,
        me: PlaneIdentity,
        tls: TlsConfig | None,
        dial_lanes: bool,
        failure: Callable[[str], PlaneError | None],
        direct_keys: set[str],
    ) -> None:
        self._token = token
        self._me = me
        self._tls = tls
        self._dial_lanes = dial_lanes
        self._failure = failure  # the failure of a stream key (the inbound half keeps them)
        self._direct_keys = direct_keys  # keys whose lanes the receivers' threads read (node/direct_lane.py)
        self._tls_checked: set[int] = set()  # peers whose certificate passed the first probe
        self._lane_ports: dict[int, asyncio.Future[tuple[int, str]]] = {}
        self._channels: dict[int, Any] = {}
        self.streams: dict[tuple[int, str], OutStream | LaneStream] = {}
        self._telling: set[asyncio.Future[None]] = set()  # error frames on their way to other ranks
        self._closed = False

    def kinds(self) -> set[str]:
        """How the open links move frames: ``"lane-unix"`` / ``"lane-tcp"`` or ``"grpc-stream"``."""
        return {s.kind if isinstance(s, LaneStream) else "grpc-stream" for s in list(self.streams.values())}

    def ready_lane(self, dst: int, key: str) -> LaneStream | None:
        """``dst``'s open lane for ``key`` (from any thread), or None: not opened yet, a gRPC stream (TLS),
        broken, failed, or the plane is closing."""
        s = self.streams.get((dst, key))
        if (
            not isinstance(s, LaneStream)
            or self._me.closing
            or not s.ready()
            or self._failure(key) is not None
        ):
            return None
        return s

    async def stream(self, dst: int, key: str) -> OutStream | LaneStream:
        """The link to ``dst`` for ``key``, opened on first use."""
        if self._me.closing:
            raise PlaneClosed("the plane was shut down")
        return await self._open(dst, key)

    def telling(self, task: asyncio.Future[None]) -> None:
        """Keep ``task`` (an error frame to another rank) until it is done: ``told`` waits for it."""
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def told(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the error frames on their way have gone out."""
        if self._telling:
            await asyncio.wait(list(self._telling), timeout=timeout_s)

    async def close(self, grace: float) -> None:
        """Say goodbye to every live peer, finish every link (delivering what was written), close channels."""
        streams = list(self.streams.values())
        if self._closed:  # streams a pending open added after the first close: nothing is written on them
            for s in streams:
                _drop(s)
            self.streams.clear()
            return
        self._closed = True
        # A parked lane is read only while a receive runs: its peer closes it at its own shutdown.
        parked = {id(s) for (_, key), s in self.streams.items() if key in self._direct_keys}
        self.streams.clear()
        eos = peer_pb2.FrameHeader(src=self._me.rank, end_of_stream=True).SerializeToString()

        async def finish(s: OutStream | LaneStream) -> None:
            try:
                if self._me.gone(s.dst):  # it reads nothing more: do not wait for it
                    raise PlaneClosed(f"rank {s.dst} is gone")
                if not s.broken:
                    await s.send_frame([eos])
                if isinstance(s, LaneStream):
                    await s.finish(wait=id(s) not in parked)
                else:
                    await s.call.done_writing()
                    await s.call
            except BaseException:
                _drop(s)

        # First a goodbye to every live peer on a fresh stream, awaited until the peer has read it:
        # a data stream cut mid-frame (a failed op) then ends without alarming the receiver.
        bound = min(grace, 1.0)
        goodbyes = []
        for dst in sorted(d for d in {s.dst for s in streams} if not self._me.gone(d)):
            goodbye = await best_effort(self._open(dst, GOODBYE_KEY), bound)
            if goodbye is not None:
                goodbyes.append(goodbye)
        if goodbyes:
            await asyncio.wait([asyncio.ensure_future(finish(s)) for s in goodbyes], timeout=bound)
        if streams:
            await asyncio.wait([asyncio.ensure_future(finish(s)) for s in streams], timeout=grace)
        for ch in self._channels.values():
            # grpc.aio's close waits for its calls to end: bounded, so one it cannot cancel does not hang the shutdown.
            try:
                await within(ch.close(grace=None), max(grace, 1.0))
            except asyncio.TimeoutError:
                log.warning(
                    "a gRPC channel to a peer did not close within %.1f s; left to the process exit", grace
                )
        self._channels.clear()

    # -- dialing ---------------------------------------------------------------------------------
    def _channel(self, dst: int) -> Any:
        ch = self._channels.get(dst)
        if ch is None:
            address = self._me.addresses[dst]
            if self._tls:
                creds = grpc.ssl_channel_credentials(root_certificates=self._tls.root_cert)
                ch = grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)
            else:
                ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[dst] = ch
        return ch

    async def _hello(self, dst: int, timeout_s: float, wait_for_ready: bool) -> peer_pb2.HelloResponse:
        hello = self._channel(dst).unary_unary(
            HELLO_METHOD,
            request_serializer=peer_pb2.HelloRequest.SerializeToString,
            response_deserializer=peer_pb2.HelloResponse.FromString,
        )
        reply = await hello(
            peer_pb2.HelloRequest(rank=self._me.rank),
            metadata=token_metadata(self._token),
            timeout=timeout_s,
            wait_for_ready=wait_for_ready,
        )
        assert isinstance(reply, peer_pb2.HelloResponse)
        return reply

    async def _peer_lane_port(self, dst: int) -> tuple[int, str]:
        """``dst``'s lane port (0: none) and Unix socket name ("": none), asked once over gRPC."""
        fut = self._lane_ports.get(dst)
        if fut is None:
            fut = self._lane_ports[dst] = asyncio.ensure_future(self._ask_lane_port(dst))
        return await asyncio.shield(fut)

    async def _ask_lane_port(self, dst: int) -> tuple[int, str]:
        try:
            reply = await self._hello(dst, CONFIGURE_WAIT_S, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise PeerLost(f"rank {dst} is unreachable: {exc.code().name} {exc.details()}", dst) from None
        return int(reply.lane_port), str(reply.lane_path)

    async def _check_tls_peer(self, dst: int) -> None:
        """AuthError at once when ``dst``'s certificate fails verification (another CA, wrong name): the stream
        itself would wait for a ready channel until the collective's timeout and say nothing of why."""
        try:
            await self._hello(dst, HELLO_TLS_S, wait_for_ready=False)
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if exc.code() == grpc.StatusCode.UNAVAILABLE and (
                "handshake" in details.lower() or "CERT" in details
            ):
                raise AuthError(
                    f"rank {dst} at {self._me.addresses[dst]} failed TLS verification "
                    f"({details.splitlines()[0]}): every rank's certificate must be signed by the CA in "
                    "PARAMPLANE_TLS_CA and name its address",
                ) from None
            # Anything else (not up yet, slow): the stream's own wait and the collective's timeout decide.

    async def _open(self, dst: int, key: str) -> OutStream | LaneStream:
        me = self._me
        s = self.streams.get((dst, key))
        if s is None and self._dial_lanes:
            port, path = await self._peer_lane_port(dst)
            s = self.streams.get((dst, key))  # another sender may have opened it meanwhile
            if s is None and port:
                host, _ = parse_address(me.addresses[dst], f"rank {dst}'s address")
                lane = LaneStream(dst, host, port, path)
                self.streams[(dst, key)] = lane
                opening = peer_pb2.StreamOpen(src=me.rank, job_id=me.job_id, group=key)
                lane.opened = asyncio.ensure_future(
                    # The receiver may wait up to CONFIGURE_WAIT_S for its group before it admits the lane.
                    lane.connect(
                        self._token, opening.SerializeToString(), CONFIGURE_WAIT_S + HANDSHAKE_TIMEOUT_S
                    )
                )
                s = lane
        if s is None and self._tls and dst not in self._tls_checked:
            await self._check_tls_peer(dst)
            self._tls_checked.add(dst)
            s = self.streams.get((dst, key))  # another sender may have opened it meanwhile
        if s is None:
            method = self._channel(dst).stream_unary(PUSH_METHOD)
            call = method(metadata=token_metadata(self._token), wait_for_ready=True)
            s = self.streams[(dst, key)] = OutStream(call, dst)
            opening = peer_pb2.StreamOpen(src=me.rank, job_id=me.job_id, group=key)
            # A task, so that a cancelled first sender cannot cut the opening short.
            s.opened = asyncio.ensure_future(s.write(opening.SerializeToString()))
        assert s.opened is not None
        if not s.opened.done():
            await asyncio.shield(s.opened)
        elif s.opened.exception() is not None:
            raise s.opened.exception()  # type: ignore[misc]
        return s


def _drop(s: OutStream | LaneStream) -> None:
    """Give up a link without finishing it (its peer is gone, or nothing was written on it)."""
    if isinstance(s, LaneStream):
        s.abandon()
    else:
        s.call.cancel()
