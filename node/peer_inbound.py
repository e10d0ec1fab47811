"""The inbound half of the peer plane: this rank's data-plane server and what arrives on it.

It serves the gRPC ``Peer`` service (``Hello`` names this rank's lane port; ``Push`` takes a gRPC stream) and
the lane server (``lane.py``), admits a link only for a group this rank created and from one of its members,
parses each frame's header (nothing is unpickled) and queues frames in one inbox per (sender, stream key), or
parks point-to-point lanes for the receiving threads (``direct_lane.py``). A failure (an error frame, a peer
lost, shutdown) fails the inboxes and lanes of exactly the keys it concerns.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

import grpc

from paramplane.node.direct_lane import DirectLane, DirectLanes, left_without_sending
from paramplane.node.errors import PeerLost, PlaneClosed, PlaneError, TransportError
from paramplane.node.failures import encode_failure, from_failure_message
from paramplane.node.inbox import Inbox
from paramplane.node.lane import LaneReader, LaneServer
from paramplane.node.peer_wire import (
    CHUNK_BYTES,
    CONFIGURE_WAIT_S,
    ERROR_SUFFIX,
    GOODBYE_KEY,
    GRPC_RECEIVE_LIMIT,
    INBOX_DEPTH,
    MAX_MESSAGE_BYTES,
    SERVER_OPTIONS,
    SERVICE,
    Malformed,
    PlaneIdentity,
    TlsConfig,
    parse_header,
)
from paramplane.protos import peer_pb2
from paramplane.protos.auth import TokenAuthInterceptor
from paramplane.protos.net import within


class Inbound:
    """The server, the stream-key registry, the inboxes and the failures of one rank."""

    def __init__(
        self, *, token: str | None, me: PlaneIdentity, tls: TlsConfig | None, lane: bool, unix_lane: bool
    ) -> None:
        self._token = token
        self._me = me
        self._tls = tls
        self._lane_wanted = lane
        self._unix_lane = unix_lane
        self.lane: LaneServer | None = None
        self._server: Any = None
        self.inboxes: dict[tuple[int, str], Inbox] = {}
        self.direct = DirectLanes()
        self._stream_members: dict[str, frozenset[int]] = {}
        self._key_waiters: dict[str, asyncio.Event] = {}
        self._failures: dict[str, PlaneError] = {}
        self._global_failure: PlaneError | None = None
        self._departed: set[int] = set()
        # What each rank said, in its first error frame, made it stop: it explains a broken link to it.
        self.told: dict[int, PlaneError] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.admit_wait_s = CONFIGURE_WAIT_S
        """How long a stream for a group this rank has not created yet waits for it before it is refused."""

    async def start(self, bind_host: str) -> int:
        """Start the gRPC server on an ephemeral port (returned) and, unless under TLS, the lane server."""
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
        target = f"{bind_host}:0"
        if self._tls:
            port = server.add_secure_port(
                target, grpc.ssl_server_credentials([(self._tls.key, self._tls.cert)])
            )
        else:
            port = server.add_insecure_port(target)
        await server.start()
        self._server = server
        if self._lane_wanted:
            self.lane = LaneServer(self._token, self._lane_open, self._lane_serve)
            self.lane.reader_shape = (CHUNK_BYTES, INBOX_DEPTH)
            await self.lane.start(bind_host, unix=self._unix_lane)
        return int(port)

    async def stop(self, grace: float) -> None:
        """Fail every inbox (the plane was shut down), then stop the lane server and the gRPC server."""
        self.fail_all(PlaneClosed("the plane was shut down"))
        if self.lane is not None:
            await self.lane.close()
            self.lane = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    # -- the stream-key registry -----------------------------------------------------------------
    def register_stream_key(self, key: str, members: frozenset[int], *, direct: bool = False) -> None:
        """Declare which ranks talk on ``key`` (see ``PeerPlane.register_stream_key``); from any thread."""
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
                await within(waiter.wait(), self.admit_wait_s)
            except asyncio.TimeoutError:
                self._key_waiters.pop(base, None)
                return f"no group {base!r} was created on rank {self._me.rank} within {self.admit_wait_s:g} s"
        if src not in self._stream_members[base]:
            return f"rank {src} is not a member of group {base!r}"
        return None

    # -- failures --------------------------------------------------------------------------------
    def failure(self, key: str) -> PlaneError | None:
        return self._failures.get(key) or self._global_failure

    def fail_key(self, key: str, exc: PlaneError, *, lost: int = -1) -> None:
        """Fail every inbox of stream key ``key``: its pending and later receives raise ``exc``.

        When rank ``lost`` died, frames it delivered before dying stay readable.
        """
        self._failures.setdefault(key, exc)
        first = self._failures[key]
        for (src, k), inbox in self.inboxes.items():
            if k == key:
                inbox.fail(first, drain=src == lost)
        self.direct.fail_key(key, first, lost)

    def fail_all(self, exc: PlaneError) -> None:
        if self._global_failure is None:
            self._global_failure = exc
        for key in {k for _, k in self.inboxes} | set(self._stream_members):
            self.fail_key(key, exc)

    def peer_lost(self, src: int, why: str) -> None:
        self._me.lost.add(src)
        exc = PeerLost(f"rank {src} was lost: {why}", src)
        for key, members in self._stream_members.items():
            if src in members:
                self.fail_key(key, exc, lost=src)

    def sender_left(self, src: int) -> None:
        """Rank ``src`` left the world and its plane flushed what it sent (see ``PeerPlane.sender_left``)."""
        self.direct.sender_left(src)
        for (rank, key), inbox in self.inboxes.items():
            if rank == src:
                inbox.fail(left_without_sending(src, key), drain=True)

    def inbox(self, src: int, key: str) -> Inbox:
        inbox = self.inboxes.get((src, key))
        if inbox is None:
            inbox = self.inboxes[(src, key)] = Inbox(INBOX_DEPTH)
            failure = self.failure(key)
            if failure is not None:
                inbox.fail(failure)
            elif src in self.direct.gone:
                inbox.fail(left_without_sending(src, key))
        return inbox

    # -- gRPC streams ----------------------------------------------------------------------------
    async def _hello(self, request: peer_pb2.HelloRequest, context: Any) -> peer_pb2.HelloResponse:
        port, path = (self.lane.port, self.lane.path) if self.lane is not None else (0, "")
        return peer_pb2.HelloResponse(
            rank=self._me.rank, job_id=self._me.job_id, lane_port=port, lane_path=path
        )

    async def _push(self, requests: AsyncIterator[bytes], context: Any) -> bytes:
        it = requests.__aiter__()
        try:
            opening = peer_pb2.StreamOpen.FromString(await it.__anext__())
        except Exception:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "TransportError: malformed stream opening")
        # A peer that learned the world first may dial before this rank has read its own join answer.
        try:
            await within(self._me.configured.wait(), CONFIGURE_WAIT_S)
        except asyncio.TimeoutError:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "TransportError: this rank has not joined a world"
            )
        if opening.job_id != self._me.job_id or not 0 <= opening.src < len(self._me.addresses):
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
                    raise Malformed(
                        f"message too large: {len(message)} bytes, the limit is {MAX_MESSAGE_BYTES}",
                        oversized=True,
                    )
                if remaining:
                    remaining -= 1
                    await inbox.put(message)
                    continue
                header = parse_header(message)
                if self._on_header(src, key, header, errors_only):
                    clean = True
                elif not header.HasField("failure"):
                    remaining = header.num_chunks
                    await inbox.put(header)
            # grpc.aio ends the iterator quietly when the sender dies, so only an explicit
            # end-of-stream frame counts as a clean close.
        except Malformed as exc:
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
            self.told.setdefault(src, failure)
            if isinstance(failure, PeerLost) and failure.rank >= 0:
                self._me.lost.add(failure.rank)
            self.fail_key(key, failure)
        elif errors_only:
            raise Malformed("a data frame on an error stream")
        return False

    def _stream_ended(self, src: int, inbox: Inbox, clean: bool, what: str) -> None:
        if not clean and not self._me.closing and inbox.error is None and src not in self._departed:
            self.peer_lost(
                src,
                f"its {what} ended without a goodbye (process died, network failed, or it sent a message "
                f"over {GRPC_RECEIVE_LIMIT >> 20} MiB)",
            )

    # -- lanes (node/lane.py) --------------------------------------------------------------------
    async def _lane_open(self, opening: peer_pb2.StreamOpen) -> str | None:
        """The stream key of an authenticated lane opening, or None to refuse it."""
        try:
            await within(self._me.configured.wait(), CONFIGURE_WAIT_S)
        except asyncio.TimeoutError:
            return None
        if (
            opening.job_id != self._me.job_id
            or not 0 <= opening.src < len(self._me.addresses)
            or not opening.group
        ):
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
                header = parse_header(raw)
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
        except (Malformed, ValueError) as exc:
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
            parse=parse_header,
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
            if not self._me.closing and src not in self._departed:
                self.peer_lost(src, what)
        else:
            self.fail_key(key, what)
