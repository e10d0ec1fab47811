"""The peer plane: this rank's data-plane gRPC server, its outbound links and its inboxes.

Frames travel by default on lanes (``lane.py``): raw sockets (an abstract Unix socket on one machine, TCP
between hosts) whose port each rank's gRPC ``Hello`` names and which open with an HMAC of the job token.
Under TLS, or with ``PARAMPLANE_TCP_LANE=0``, the same frames ride long-lived gRPC client streams of raw
bytes (identity serializers). Either way a link's first message is an encoded ``StreamOpen`` naming the
sender and the stream key (one link per process group and direction, so groups never block one another);
after it the sender writes, for every frame, an encoded ``FrameHeader`` and then the raw payload. Only
headers are parsed; nothing is unpickled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from paramplane.node.direct_lane import DirectLane, DirectLanes, left_without_sending
from paramplane.node.errors import (
    AuthError,
    PeerLost,
    PlaneClosed,
    PlaneError,
    TransportError,
)
from paramplane.node.failures import (
    KINDS,
    decode_failure,
    encode_failure,
    from_failure_message,
)
from paramplane.node.inbox import Inbox
from paramplane.node.lane import HANDSHAKE_TIMEOUT_S, LaneReader, LaneServer, LaneStream
from paramplane.protos import peer_pb2
from paramplane.protos.auth import TokenAuthInterceptor, token_metadata
from paramplane.protos.net import parse_address

log = logging.getLogger("paramplane.peer")

SERVICE = "paramplane.v1.Peer"
PUSH_METHOD = f"/{SERVICE}/Push"
CHUNK_BYTES = 1 << 20
# Header plus one chunk: the largest message a rank sends. A larger one is refused with a
# TransportError naming its size; gRPC itself drops messages over GRPC_RECEIVE_LIMIT unseen.
MAX_MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)
GRPC_RECEIVE_LIMIT = 16 << 20
INBOX_DEPTH = 16
CONFIGURE_WAIT_S = 30.0
HELLO_TLS_S = 10.0
"""How long the first TLS probe of a peer may take before the stream's own wait takes over."""
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]
SERVER_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", GRPC_RECEIVE_LIMIT),
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

# Sent on a stream of its own when a plane closes, so receivers know the sender left on purpose.
GOODBYE_KEY = "#bye"


class _Malformed(Exception):
    def __init__(self, message: str, *, oversized: bool = False) -> None:
        super().__init__(message)
        self.oversized = oversized


def _parse_header(message: bytes) -> peer_pb2.FrameHeader:
    try:
        header = peer_pb2.FrameHeader.FromString(message)
    except Exception as exc:
        raise _Malformed(f"undecodable frame header ({len(message)} bytes)") from exc
    payload = len(header.inline_payload)
    if (
        header.nbytes < 0
        or header.num_chunks < 0
        or header.num_chunks * CHUNK_BYTES + payload < header.nbytes
    ):
        raise _Malformed(f"frame header with nbytes={header.nbytes}, num_chunks={header.num_chunks}")
    return header


@dataclass(frozen=True)
class TlsConfig:
    """PEM material for the data plane; every rank serves with its cert and trusts ``root_cert``."""

    cert: bytes
    key: bytes = field(repr=False)  # the private key: never in a repr or a traceback's locals
    root_cert: bytes


ERROR_SUFFIX = "#err"


def _consume_exception(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a frame whose sender gave up: its error was raised there, or is moot


class OutStream:
    """One outbound stream to a peer.

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
        task.add_done_callback(_consume_exception)
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
        details = ""
        try:
            details = (await asyncio.wait_for(self.call.details(), 1.0)) or ""
        except BaseException:
            pass
        if details.split(": ", 1)[0].split("[", 1)[0] in KINDS:
            return decode_failure(details)
        return PeerLost(f"rank {self.dst} is unreachable: the data stream to it broke ({exc!r})", self.dst)


class PeerPlane:
    """The data-plane server, the outbound streams and the inboxes of one rank."""

    def __init__(
        self,
        *,
        token: str | None,
        bind_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        tls: TlsConfig | None = None,
        lane: bool = True,
        unix_lane: bool = True,
    ) -> None:
        self._token = token
        self._lane_wanted = lane and tls is None
        self._unix_lane = unix_lane
        self._lane: LaneServer | None = None
        self._lane_ports: dict[int, asyncio.Future[tuple[int, str]]] = {}
        self._bind_host = bind_host
        self._advertise_host = advertise_host or bind_host
        self._tls = tls
        self._tls_checked: set[int] = set()  # peers whose certificate passed the first probe
        self._server: Any = None
        self.rank = -1
        self.job_id = ""
        self._addresses: dict[int, str] = {}
        self._channels: dict[int, Any] = {}
        self._streams: dict[tuple[int, str], OutStream | LaneStream] = {}
        self._inboxes: dict[tuple[int, str], Inbox] = {}
        self.direct = DirectLanes()
        self._stream_members: dict[str, frozenset[int]] = {}
        self._failures: dict[str, PlaneError] = {}
        self._telling: set[asyncio.Future[None]] = set()  # error frames on their way to other ranks
        self._global_failure: PlaneError | None = None
        self._closing = False
        self._departed: set[int] = set()
        self._configured = asyncio.Event()
        self._key_waiters: dict[str, asyncio.Event] = {}
        self.admit_wait_s = CONFIGURE_WAIT_S
        """How long a stream for a group this rank has not created yet waits for it before it is refused."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self.lost: set[int] = set()

    @property
    def frames_ride(self) -> str:
        """How frames to other ranks travel: ``"lane"`` (raw sockets, Unix or TCP; the default) or
        ``"grpc-stream"`` (under TLS or with ``PARAMPLANE_TCP_LANE=0``). Traces label that traffic with it."""
        return "lane" if self._lane_wanted else "grpc-stream"

    @property
    def serves_lanes(self) -> bool:
        """Whether this rank listens for lanes (raw sockets); never under TLS, whose frames ride gRPC streams."""
        return self._lane is not None

    def outbound_kinds(self) -> set[str]:
        """How this rank's open outbound links move frames: ``"lane-unix"`` / ``"lane-tcp"`` (a raw socket) or
        ``"grpc-stream"``."""
        return {s.kind if isinstance(s, LaneStream) else "grpc-stream" for s in list(self._streams.values())}

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> str:
        """Start the server on an ephemeral port; returns the address to advertise."""
        self._loop = asyncio.get_running_loop()
        server = grpc.aio.server(interceptors=[TokenAuthInterceptor(self._token)], options=SERVER_OPTIONS)
        handlers = {
            "Push": grpc.stream_unary_rpc_method_handler(self._push),
            "Hello": grpc.unary_unary_rpc_method_handler(
                self._hello,
                request_deserializer=peer_pb2.HelloRequest.FromString,
                response_serializer=peer_pb2.HelloResponse.SerializeToString,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        target = f"{self._bind_host}:0"
        if self._tls:
            creds = grpc.ssl_server_credentials([(self._tls.key, self._tls.cert)])
            port = server.add_secure_port(target, creds)
        else:
            port = server.add_insecure_port(target)
        await server.start()
        self._server = server
        if self._lane_wanted:
            self._lane = LaneServer(self._token, self._lane_open, self._lane_serve)
            self._lane.reader_shape = (CHUNK_BYTES, INBOX_DEPTH)
            await self._lane.start(self._bind_host, unix=self._unix_lane)
        return f"{self._advertise_host}:{port}"

    def configure(self, rank: int, job_id: str, addresses: dict[int, str]) -> None:
        """Learn this rank's identity and every peer's address (after the world formed)."""
        self.rank = rank
        self.job_id = job_id
        self._addresses = dict(addresses)
        self._configured.set()

    def register_stream_key(self, key: str, members: frozenset[int], *, direct: bool = False) -> None:
        """Declare which ranks talk on ``key``: only they may open streams for it here, and a lost peer
        fails exactly the keys it belongs to. With ``direct`` its lanes are parked for receiving threads to
        read (``node/direct_lane.py``). Callable from any thread; it takes effect on the loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                loop.call_soon_threadsafe(self._register, key, members, direct)
                return
        self._register(key, members, direct)

    def _register(self, key: str, members: frozenset[int], direct: bool = False) -> None:
        if direct:
            self.direct.keys.add(key)
        self._stream_members[key] = members
        if self._global_failure is not None:
            self._failures.setdefault(key, self._global_failure)
        waiter = self._key_waiters.pop(key, None)
        if waiter is not None:
            waiter.set()

    async def _admit(self, src: int, key: str) -> str | None:
        """None if ``src`` may send on ``key`` here (waiting briefly for this rank to create the group), else why not."""
        if key == GOODBYE_KEY:
            return None
        base = key.removesuffix(ERROR_SUFFIX)
        if base not in self._stream_members:
            waiter = self._key_waiters.setdefault(base, asyncio.Event())
            try:
                await asyncio.wait_for(waiter.wait(), self.admit_wait_s)
            except asyncio.TimeoutError:
                self._key_waiters.pop(base, None)
                return f"no group {base!r} was created on rank {self.rank} within {self.admit_wait_s:g} s"
        if src not in self._stream_members[base]:
            return f"rank {src} is not a member of group {base!r}"
        return None

    def telling(self, task: asyncio.Future[None]) -> None:
        """Keep ``task`` (an error frame to another rank) until it is done: ``told`` waits for it."""
        self._telling.add(task)
        task.add_done_callback(self._telling.discard)

    async def told(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the error frames on their way have gone out: a rank that leaves
        first would reach its peers as a departure (PeerLost) instead of the error it found."""
        if self._telling:
            await asyncio.wait(list(self._telling), timeout=timeout_s)

    async def close(self, grace: float = 1.0) -> None:
        """Finish every outbound stream (delivering what was written), then stop the server."""
        self._closing = True
        streams = list(self._streams.values())
        # A parked lane is read only while a receive runs: its peer closes it at its own shutdown.
        parked = {id(s) for (_, key), s in self._streams.items() if key in self.direct.keys}
        self._streams.clear()

        eos = peer_pb2.FrameHeader(src=self.rank, end_of_stream=True).SerializeToString()

        async def finish(s: OutStream | LaneStream) -> None:
            try:
                if not s.broken:
                    await s.send_frame([eos])
                if isinstance(s, LaneStream):
                    await s.finish(wait=id(s) not in parked)
                else:
                    await s.call.done_writing()
                    await s.call
            except BaseException:
                if isinstance(s, LaneStream):
                    s.abandon()

        # First a goodbye to every live peer on a fresh stream, awaited until the peer has read it:
        # a data stream cut mid-frame (a failed op) then ends without alarming the receiver.
        bound = min(grace, 1.0)
        goodbyes = []
        for dst in sorted({s.dst for s in streams} - self.lost):
            try:
                goodbyes.append(await asyncio.wait_for(self._open(dst, GOODBYE_KEY), bound))
            except BaseException:
                pass
        if goodbyes:
            await asyncio.wait([asyncio.ensure_future(finish(s)) for s in goodbyes], timeout=bound)
        if streams:
            await asyncio.wait([asyncio.ensure_future(finish(s)) for s in streams], timeout=grace)
        for ch in self._channels.values():
            await ch.close(grace=None)
        self._channels.clear()
        self.fail_all(PlaneClosed("the plane was shut down"))
        if self._lane is not None:
            await self._lane.close()
            self._lane = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    # -- failures --------------------------------------------------------------------------------
    def failure(self, key: str) -> PlaneError | None:
        return self._failures.get(key) or self._global_failure

    def fail_key(self, key: str, exc: PlaneError, *, lost: int = -1) -> None:
        """Fail every inbox of stream key ``key``: its pending and later receives raise ``exc``.

        When rank ``lost`` died, frames it delivered before dying stay readable.
        """
        self._failures.setdefault(key, exc)
        first = self._failures[key]
        for (src, k), inbox in self._inboxes.items():
            if k == key:
                inbox.fail(first, drain=src == lost)
        self.direct.fail_key(key, first, lost)

    def fail_all(self, exc: PlaneError) -> None:
        if self._global_failure is None:
            self._global_failure = exc
        for key in {k for _, k in self._inboxes} | set(self._stream_members):
            self.fail_key(key, exc)

    def peer_lost(self, src: int, why: str) -> None:
        self.lost.add(src)
        exc = PeerLost(f"rank {src} was lost: {why}", src)
        for key, members in self._stream_members.items():
            if src in members:
                self.fail_key(key, exc, lost=src)

    def sender_left(self, src: int) -> None:
        """Rank ``src`` left the world and its plane has flushed what it sent (on the loop): a receive from it
        reads what it delivered, then fails with PeerLost instead of waiting out the group's timeout."""
        self.direct.sender_left(src)
        for (rank, key), inbox in self._inboxes.items():
            if rank == src:
                inbox.fail(left_without_sending(src, key), drain=True)

    # -- receiving -------------------------------------------------------------------------------
    def inbox(self, src: int, key: str) -> Inbox:
        inbox = self._inboxes.get((src, key))
        if inbox is None:
            inbox = self._inboxes[(src, key)] = Inbox(INBOX_DEPTH)
            failure = self.failure(key)
            if failure is not None:
                inbox.fail(failure)
            elif src in self.direct.gone:
                inbox.fail(left_without_sending(src, key))
        return inbox

    def is_direct(self, key: str) -> bool:
        """Whether frames on ``key`` come on lanes its receiving threads read (not through an inbox)."""
        return self._lane is not None and key in self.direct.keys

    def existing_inbox(self, src: int, key: str) -> Inbox | None:
        """The inbox of (``src``, ``key``) if one was made (from any thread; ``inbox`` makes them, on the loop)."""
        return self._inboxes.get((src, key))

    async def _hello(self, request: peer_pb2.HelloRequest, context: Any) -> peer_pb2.HelloResponse:
        port, path = (self._lane.port, self._lane.path) if self._lane is not None else (0, "")
        return peer_pb2.HelloResponse(rank=self.rank, job_id=self.job_id, lane_port=port, lane_path=path)

    async def _push(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        it = requests.__aiter__()
        try:
            opening = peer_pb2.StreamOpen.FromString(await it.__anext__())
        except Exception:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "TransportError: malformed stream opening")
        # A peer that learned the world first may dial before this rank has read its own join answer.
        try:
            await asyncio.wait_for(self._configured.wait(), CONFIGURE_WAIT_S)
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "TransportError: this rank has not joined a world"
            )
        if opening.job_id != self.job_id or not 0 <= opening.src < len(self._addresses):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"TransportError: stream from rank {opening.src} of job {opening.job_id!r} does not belong here",
            )
        refused = await self._admit(opening.src, opening.group)
        if refused is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"TransportError: {refused}")
        src, key = opening.src, opening.group
        errors_only = key.endswith(ERROR_SUFFIX)
        if errors_only:
            key = key[: -len(ERROR_SUFFIX)]
        inbox = self.inbox(src, key)
        clean = False
        try:
            # Frame-aware: parse each header here, so an error frame fails the key at once
            # even while the consumer waits on another peer's inbox.
            remaining = 0
            async for message in it:
                if len(message) > MAX_MESSAGE_BYTES:
                    raise _Malformed(
                        f"message too large: {len(message)} bytes, the limit is {MAX_MESSAGE_BYTES}",
                        oversized=True,
                    )
                if remaining:
                    remaining -= 1
                    await inbox.put(message)
                    continue
                header = _parse_header(message)
                if self._on_header(src, key, header, errors_only):
                    clean = True
                elif not header.HasField("failure"):
                    remaining = header.num_chunks
                    await inbox.put(header)
            # grpc.aio ends the iterator quietly when the sender dies, so only an explicit
            # end-of-stream frame counts as a clean close.
        except _Malformed as exc:
            what = "oversized message" if exc.oversized else "malformed frame"
            self.fail_key(key, TransportError(f"{what} from rank {src}: {exc}"))
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if exc.oversized else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, f"TransportError: {exc}")
        except PlaneError as exc:
            await context.abort(grpc.StatusCode.ABORTED, encode_failure(exc))
        finally:
            self._stream_ended(src, inbox, clean, "data stream")
        return b""

    def _on_header(self, src: int, key: str, header: peer_pb2.FrameHeader, errors_only: bool) -> bool:
        """Handle a control header (end of stream, error); True for end of stream. Data headers pass."""
        if header.end_of_stream:
            self._departed.add(src)
            if not errors_only:
                # Everything ``src`` sent on this key came before this frame: what is queued stays
                # readable, a receive beyond it could never be satisfied.
                self.inbox(src, key).fail(
                    PeerLost(
                        f"rank {src} shut down: it sent nothing more for group '{key}' before leaving", src
                    ),
                    drain=True,
                )
            return True
        if header.HasField("failure"):
            failure = from_failure_message(header.failure)
            if isinstance(failure, PeerLost) and failure.rank >= 0:
                self.lost.add(failure.rank)
            self.fail_key(key, failure)
        elif errors_only:
            raise _Malformed("a data frame on an error stream")
        return False

    def _stream_ended(self, src: int, inbox: Inbox, clean: bool, what: str) -> None:
        if not clean and not self._closing and inbox.error is None and src not in self._departed:
            self.peer_lost(
                src,
                f"its {what} ended without a goodbye (process died, network failed, or it sent a message "
                f"over {GRPC_RECEIVE_LIMIT >> 20} MiB)",
            )

    # -- the raw TCP lane (node/lane.py) ---------------------------------------------------------
    async def _lane_open(self, opening: peer_pb2.StreamOpen) -> str | None:
        """The stream key of an authenticated lane opening, or None to refuse it."""
        try:
            await asyncio.wait_for(self._configured.wait(), CONFIGURE_WAIT_S)
        except asyncio.TimeoutError:
            return None
        if opening.job_id != self.job_id or not 0 <= opening.src < len(self._addresses) or not opening.group:
            return None
        if await self._admit(opening.src, opening.group) is not None:
            return None
        return opening.group

    async def _lane_serve(self, src: int, key: str, errors_only: bool, reader: LaneReader) -> None:
        if errors_only:
            key = key[: -len(ERROR_SUFFIX)]
        elif key in self.direct.keys:
            await self._park(src, key, reader)
            return
        inbox = self.inbox(src, key)
        clean = False
        discard = False  # the key failed here: keep reading (the sender must not see a broken lane), drop

        async def deliver(item: Any) -> None:
            nonlocal discard
            if not discard:
                try:
                    await inbox.put(item)
                except PlaneError:
                    discard = True

        try:
            while True:
                raw = await reader.read_header(MAX_MESSAGE_BYTES)
                if raw is None:
                    break
                header = _parse_header(raw)
                if self._on_header(src, key, header, errors_only):
                    clean = True
                    break
                if header.HasField("failure"):
                    continue
                await deliver(header)
                remaining = header.nbytes if header.num_chunks else 0
                while remaining > 0:
                    size = min(CHUNK_BYTES, remaining)
                    await deliver(await reader.read_chunk(size))
                    remaining -= size
        except (_Malformed, ValueError) as exc:
            self.fail_key(key, TransportError(f"malformed frame from rank {src} on its data lane: {exc}"))
        except OSError:
            pass  # the sender died or the network failed: not clean, see below
        finally:
            self._stream_ended(src, inbox, clean, "data lane")

    async def _park(self, src: int, key: str, reader: LaneReader) -> None:
        """Hand a point-to-point lane to its receiving threads until shutdown closes it."""
        lane = DirectLane(
            reader.sock,
            src,
            key,
            chunk_bytes=CHUNK_BYTES,
            max_header_bytes=MAX_MESSAGE_BYTES,
            parse=_parse_header,
            report=functools.partial(self._direct_report, src, key),
        )
        self.direct.park(lane, self.failure(key))
        try:
            await asyncio.Event().wait()
        finally:
            self.direct.unpark(lane, PlaneClosed("the plane was shut down"))

    def _direct_report(self, src: int, key: str, kind: str, what: Any) -> None:
        """What a parked lane's reader found, for the plane to act on (from the reader's thread)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._on_direct_report, src, key, kind, what)
        except RuntimeError:
            pass  # the loop stopped meanwhile

    def _on_direct_report(self, src: int, key: str, kind: str, what: Any) -> None:
        if kind == "header":
            self._on_header(src, key, what, False)
        elif kind == "lost":
            if not self._closing and src not in self._departed:
                self.peer_lost(src, what)
        else:
            self.fail_key(key, what)

    async def _peer_lane_port(self, dst: int) -> tuple[int, str]:
        """``dst``'s lane port (0: none) and Unix socket name ("": none), asked once over gRPC."""
        fut = self._lane_ports.get(dst)
        if fut is None:
            fut = self._lane_ports[dst] = asyncio.ensure_future(self._ask_lane_port(dst))
        return await asyncio.shield(fut)

    async def _ask_lane_port(self, dst: int) -> tuple[int, str]:
        hello = self._channel(dst).unary_unary(
            f"/{SERVICE}/Hello",
            request_serializer=peer_pb2.HelloRequest.SerializeToString,
            response_deserializer=peer_pb2.HelloResponse.FromString,
        )
        try:
            reply = await hello(
                peer_pb2.HelloRequest(rank=self.rank),
                metadata=token_metadata(self._token),
                timeout=CONFIGURE_WAIT_S,
                wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as exc:
            raise PeerLost(f"rank {dst} is unreachable: {exc.code().name} {exc.details()}", dst) from None
        return int(reply.lane_port), str(reply.lane_path)

    async def _check_tls_peer(self, dst: int) -> None:
        """AuthError at once when ``dst``'s certificate fails verification (another CA, wrong name): the stream
        itself would wait for a ready channel until the collective's timeout and say nothing of why."""
        hello = self._channel(dst).unary_unary(
            f"/{SERVICE}/Hello",
            request_serializer=peer_pb2.HelloRequest.SerializeToString,
            response_deserializer=peer_pb2.HelloResponse.FromString,
        )
        try:
            await hello(
                peer_pb2.HelloRequest(rank=self.rank),
                metadata=token_metadata(self._token),
                timeout=HELLO_TLS_S,
            )
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if exc.code() == grpc.StatusCode.UNAVAILABLE and (
                "handshake" in details.lower() or "CERT" in details
            ):
                raise AuthError(
                    f"rank {dst} at {self._addresses[dst]} failed TLS verification ({details.splitlines()[0]}): "
                    "every rank's certificate must be signed by the CA in PARAMPLANE_TLS_CA and name its address",
                ) from None
            # Anything else (not up yet, slow): the stream's own wait and the collective's timeout decide.

    # -- sending ---------------------------------------------------------------------------------
    def _channel(self, dst: int) -> Any:
        ch = self._channels.get(dst)
        if ch is None:
            address = self._addresses[dst]
            if self._tls:
                creds = grpc.ssl_channel_credentials(root_certificates=self._tls.root_cert)
                ch = grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)
            else:
                ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[dst] = ch
        return ch

    @property
    def closing(self) -> bool:
        """The plane is shutting down: its streams are finishing and take no more frames."""
        return self._closing

    def ready_lane(self, dst: int, key: str) -> LaneStream | None:
        """``dst``'s open lane for ``key`` (from any thread), or None: not opened yet, a gRPC stream (TLS),
        broken, failed, or the plane is closing."""
        s = self._streams.get((dst, key))
        if not isinstance(s, LaneStream) or self._closing or not s.ready() or self.failure(key) is not None:
            return None
        return s

    async def stream(self, dst: int, key: str) -> OutStream | LaneStream:
        """The outbound stream to ``dst`` for ``key``, opened on first use."""
        if self._closing:
            raise PlaneClosed("the plane was shut down")
        return await self._open(dst, key)

    async def _open(self, dst: int, key: str) -> OutStream | LaneStream:
        s = self._streams.get((dst, key))
        if s is None and self._lane is not None:
            port, path = await self._peer_lane_port(dst)
            s = self._streams.get((dst, key))  # another sender may have opened it meanwhile
            if s is None and port:
                host, _ = parse_address(self._addresses[dst], f"rank {dst}'s address")
                lane = LaneStream(dst, host, port, path)
                self._streams[(dst, key)] = lane
                opening = peer_pb2.StreamOpen(src=self.rank, job_id=self.job_id, group=key)
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
            s = self._streams.get((dst, key))  # another sender may have opened it meanwhile
        if s is None:
            method = self._channel(dst).stream_unary(PUSH_METHOD)
            call = method(metadata=token_metadata(self._token), wait_for_ready=True)
            s = self._streams[(dst, key)] = OutStream(call, dst)
            opening = peer_pb2.StreamOpen(src=self.rank, job_id=self.job_id, group=key)
            # A task, so that a cancelled first sender cannot cut the opening short.
            s.opened = asyncio.ensure_future(s.write(opening.SerializeToString()))
        assert s.opened is not None
        if not s.opened.done():
            await asyncio.shield(s.opened)
        elif s.opened.exception() is not None:
            raise s.opened.exception()  # type: ignore[misc]
        return s
