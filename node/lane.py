"""The raw TCP data lane: the peer plane's frames on plain sockets, beside its gRPC streams.

grpc.aio copies every byte about three times in user space on one Python thread, which caps a
64 MiB exchange at about 0.45x of gloo on loopback (measured when the lanes were designed).
A lane carries the same frames (a length-prefixed ``FrameHeader``, then ``nbytes`` of raw
payload) over one socket per (sender, stream key): the sender writes straight from the array
(``sock_sendall`` of a memoryview) and the receiver reads chunks into a small pool of reused
buffers that the inbox hands to the op's sink, so a byte is copied once by the kernel and once
by the reduction, as gloo does. gRPC still carries the rendezvous of each lane (``Hello`` names
the lane port) and all frames where TLS is on (lanes are plaintext, so TLS turns them off).

A connection opens with the server's 16-byte nonce; the client answers with a length-prefixed
``StreamOpen`` and ``HMAC-SHA256(job token, nonce + opening)``, so the token never crosses
the wire and a replayed opening fails. The server closes any connection whose opening, MAC,
header or size is wrong; a connection that ends without an end-of-stream frame counts as a lost
peer, exactly like a gRPC stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from paramplane.node.errors import PeerLost, PlaneError, TransportError
from paramplane.protos import peer_pb2
from paramplane.protos.net import best_effort, within

_log = logging.getLogger("paramplane.lane")

NONCE_BYTES = 16
MAC_BYTES = 32
MAX_OPENING_BYTES = 4096
HANDSHAKE_TIMEOUT_S = 10.0
CLOSE_WAIT_S = 5.0  # how long close() waits for its cancelled connection tasks to end
ACCEPT_BACKOFF_S = 0.05
FRAME_LENGTH = struct.Struct("!I")  # a frame header's length, before it
ABSTRACT_SOCKETS = sys.platform.startswith("linux")  # Unix socket names outside the filesystem
UNIX_BUFFER_BYTES = 4 << 20

# What the lane needs from the peer plane for each accepted connection.
Opener = Callable[[peer_pb2.StreamOpen], Awaitable[str | None]]
Serve = Callable[[int, str, bool, "LaneReader"], Awaitable[None]]


def opening_mac(token: str | None, nonce: bytes, opening: bytes) -> bytes:
    return hmac.new((token or "").encode(), nonce + opening, hashlib.sha256).digest()


async def _recv_exact(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False on EOF before the first byte, TransportError on EOF after it."""
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            if got == 0:
                return False
            raise ConnectionResetError(f"connection closed after {got} of {len(view)} bytes")
        got += n
    return True


class LaneReader:
    """Reads one accepted connection's frames: headers, and payload chunks into reused buffers."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, chunk_bytes: int, depth: int
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.chunk_bytes = chunk_bytes
        # The inbox holds at most ``depth`` chunks and its reader consumes a chunk before it
        # awaits again, so depth + 2 buffers are never overwritten while still in use.
        self._num_buffers = depth + 2
        self._buffers: list[bytearray] = []
        self._next = 0

    async def read_header(self, max_bytes: int) -> bytes | None:
        """The next header's bytes; None at a clean end of the connection."""
        head = bytearray(FRAME_LENGTH.size)
        if not await _recv_exact(self.loop, self.sock, memoryview(head)):
            return None
        (size,) = FRAME_LENGTH.unpack(head)
        if size > max_bytes:
            raise ValueError(f"frame header of {size} bytes, the limit is {max_bytes}")
        data = bytearray(size)
        if size and not await _recv_exact(self.loop, self.sock, memoryview(data)):
            raise ConnectionResetError("connection closed inside a frame header")
        return bytes(data)

    async def read_chunk(self, size: int) -> memoryview:
        """The next ``size`` payload bytes, in a pooled buffer valid until the pool wraps around."""
        assert 0 < size <= self.chunk_bytes
        if len(self._buffers) < self._num_buffers:
            self._buffers.append(bytearray(self.chunk_bytes))
        buf = memoryview(self._buffers[self._next % len(self._buffers)])[:size]
        self._next += 1
        if not await _recv_exact(self.loop, self.sock, buf):
            raise ConnectionResetError("connection closed inside a frame payload")
        return buf


class LaneServer:
    """Accepts lane connections on ``bind_host`` (port 0: any free port) and, on Linux, on a name of its own
    in the abstract Unix socket namespace: peers on the same machine (and network namespace) connect there,
    which costs the kernel a fraction of a loopback TCP send (about 20 against 70 us here, cold)."""

    reader_shape: tuple[int, int] = (1 << 20, 16)
    """(chunk bytes, inbox depth) for readers; the peer plane sets its own."""

    def __init__(self, token: str | None, opener: Opener, serve: Serve) -> None:
        self._token = token
        self._opener = opener
        self._serve = serve
        self._socks: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._conns: set[asyncio.Task[None]] = set()
        self.port = 0
        self.path = ""

    async def start(self, bind_host: str, *, unix: bool = True) -> int:
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind_host, 0))
        self.port = int(sock.getsockname()[1])
        self._listen(sock)
        if unix and ABSTRACT_SOCKETS:
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            name = f"paramplane-lane-{secrets.token_hex(12)}"
            local.bind("\0" + name)
            self.path = name
            self._listen(local)
        return self.port

    def _listen(self, sock: socket.socket) -> None:
        sock.listen(64)
        sock.setblocking(False)
        self._socks.append(sock)
        self._accepting.append(asyncio.ensure_future(self._accept_loop(sock)))

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn = await _accept(loop, sock)
            except OSError as exc:  # out of descriptors (EMFILE) or memory: refuse this one, keep accepting
                _log.warning("data lane: accept failed (%s); retrying", exc)
                await asyncio.sleep(ACCEPT_BACKOFF_S)
                continue
            conn.setblocking(False)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                _widen_unix_buffer(conn)
            task = asyncio.ensure_future(self._handle(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _handle(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Only the greeting is bounded here: admitting the opening may wait for this rank to create the
            # group (the plane's own, longer bound), as a gRPC stream's opening does.
            message = await within(self._greet(loop, conn), HANDSHAKE_TIMEOUT_S)
            if message is None:
                return
            key = await self._opener(message)
            if key is None:
                return
            await within(loop.sock_sendall(conn, b"\x01"), HANDSHAKE_TIMEOUT_S)
            src, errors_only = message.src, key.endswith("#err")
            await self._serve(src, key, errors_only, LaneReader(loop, conn, *self.reader_shape))
        except (OSError, asyncio.TimeoutError, ValueError):
            pass  # a stranger or a broken handshake: just close
        finally:
            conn.close()

    async def _greet(
        self, loop: asyncio.AbstractEventLoop, conn: socket.socket
    ) -> peer_pb2.StreamOpen | None:
        """The authenticated opening of a new connection, or None (a stranger, a bad MAC, junk)."""
        nonce = os.urandom(NONCE_BYTES)
        await loop.sock_sendall(conn, nonce)
        head = bytearray(FRAME_LENGTH.size)
        if not await _recv_exact(loop, conn, memoryview(head)):
            return None
        (size,) = FRAME_LENGTH.unpack(head)
        if not 0 < size <= MAX_OPENING_BYTES:
            return None
        body = bytearray(size + MAC_BYTES)
        if not await _recv_exact(loop, conn, memoryview(body)):
            return None
        opening, mac = bytes(body[:size]), bytes(body[size:])
        if not hmac.compare_digest(mac, opening_mac(self._token, nonce, opening)):
            return None
        try:
            return peer_pb2.StreamOpen.FromString(opening)
        except Exception:  # authenticated but undecodable: refuse like any bad opening
            return None

    async def close(self) -> None:
        for accepting in self._accepting:
            accepting.cancel()
            await best_effort(accepting, None)
        self._accepting = []
        for task in list(self._conns):
            task.cancel()
        if self._conns:
            _, pending = await asyncio.wait(list(self._conns), timeout=CLOSE_WAIT_S)
            if pending:
                _log.warning("data lane: %d connection task(s) did not end when cancelled", len(pending))
        for sock in self._socks:
            sock.close()
        self._socks = []


async def _accept(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> socket.socket:
    """The next connection on listening ``sock``. Not ``loop.sock_accept``: cancelled while the socket is
    readable (shutdown), that accepts a connection anyway and fails to hand it over (InvalidStateError printed
    by the loop, the connection left open); here a cancelled wait accepts nothing."""
    while True:
        try:
            return sock.accept()[0]
        except (BlockingIOError, InterruptedError):
            pass
        readable = loop.create_future()
        loop.add_reader(sock.fileno(), _settle, readable)
        try:
            await readable
        finally:
            loop.remove_reader(sock.fileno())


def _widen_unix_buffer(sock: socket.socket) -> None:
    """A Unix stream socket's send buffer holds ``UNIX_BUFFER_BYTES`` (where the system allows), not the 208 KiB
    default: a larger frame then goes out in one write instead of waking the reader once per buffer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, UNIX_BUFFER_BYTES)


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _framed(header: bytes) -> bytes:
    """A frame header as it crosses the lane: its length, then its bytes."""
    return FRAME_LENGTH.pack(len(header)) + header


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


class LaneStream:
    """One outbound lane to a peer for one stream key (the lane's counterpart of ``OutStream``)."""

    def __init__(self, dst: int, host: str, port: int, path: str = "") -> None:
        self.dst = dst
        self.host = host
        self.port = port
        self.path = path  # the peer's abstract Unix socket name: tried first (same machine), else TCP
        self.sock: socket.socket | None = None
        self.lock = asyncio.Lock()
        # Held while bytes go out, by the loop (a whole frame) or by a caller thread (``send_now``).
        self.writing = threading.Lock()
        self.broken = False
        self.opened: asyncio.Future[None] | None = None

    @property
    def kind(self) -> str:
        """``"lane-unix"`` or ``"lane-tcp"``: how the connected lane moves bytes (``"lane"`` before it is)."""
        if self.sock is None:
            return "lane"
        return "lane-unix" if self.sock.family == socket.AF_UNIX else "lane-tcp"

    async def _dial(self, loop: asyncio.AbstractEventLoop) -> socket.socket:
        """A connected socket: the peer's Unix socket name when it is reachable from here, else TCP."""
        if self.path and ABSTRACT_SOCKETS:
            local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            local.setblocking(False)
            _widen_unix_buffer(local)
            try:
                await loop.sock_connect(local, "\0" + self.path)
                return local
            except OSError:  # another machine or network namespace: no such name here
                local.close()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await loop.sock_connect(sock, (self.host, self.port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def connect(self, token: str | None, opening: bytes, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        sock: socket.socket | None = None
        try:
            async with asyncio.timeout(timeout_s):
                sock = await self._dial(loop)
                nonce = bytearray(NONCE_BYTES)
                if not await _recv_exact(loop, sock, memoryview(nonce)):
                    raise ConnectionResetError("the lane closed before its greeting")
                mac = opening_mac(token, bytes(nonce), opening)
                await loop.sock_sendall(sock, FRAME_LENGTH.pack(len(opening)) + opening + mac)
                ok = bytearray(1)
                if not await _recv_exact(loop, sock, memoryview(ok)) or ok[0] != 1:
                    raise ConnectionResetError("the lane refused the opening (job, rank or token)")
        except BaseException as exc:
            if sock is not None:
                sock.close()
            self.broken = True
            if isinstance(exc, (OSError, TimeoutError)):
                raise PeerLost(
                    f"rank {self.dst} is unreachable: its data lane did not open ({exc!r})", self.dst
                ) from None
            raise
        self.sock = sock

    def ready(self) -> bool:
        """Open and whole (from any thread: a caller may then try ``send_now``)."""
        opened = self.opened
        return (
            not self.broken
            and self.sock is not None
            and opened is not None
            and opened.done()
            and not opened.cancelled()
            and opened.exception() is None
        )

    def send_now(self, data: bytes) -> bytes:
        """Write ``data``, a whole frame (its length, then a header with no payload beyond it: ``framed``), from
        the calling thread, as far as the socket takes it at once; returns what is left (empty when all went
        out), which must be ``send_raw`` next.

        Only while no frame is queued on the loop for this lane (the caller's ordering guarantees it): a small
        frame then leaves without waking the loop. Errors leave it unsent; the loop's write reports them.
        """
        if not self.writing.acquire(blocking=False):
            return data
        try:
            if self.broken or self.sock is None:
                return data
            try:
                return data[self.sock.send(data) :]
            except OSError:  # BlockingIOError: nothing taken; a broken socket fails the loop's write
                return data
        finally:
            self.writing.release()

    async def send_frame(self, messages: Iterable[Any]) -> None:
        """Write one frame whole (a header, then payload buffers), shielded from the caller's cancellation."""
        it = iter(messages)
        header = next(it)
        await self.send_raw([_framed(header), *it])

    async def send_raw(self, buffers: list[Any]) -> None:
        """Write ``buffers`` as they are, in one piece (shielded), after what was queued before."""
        assert self.opened is not None
        if not self.opened.done():
            await asyncio.shield(self.opened)
        if self.opened.exception() is not None:
            raise self.opened.exception()  # type: ignore[misc]
        task = asyncio.ensure_future(self._write(buffers))
        task.add_done_callback(_consume)
        await asyncio.shield(task)

    async def _write(self, buffers: list[Any]) -> None:
        loop = asyncio.get_running_loop()
        async with self.lock:
            if self.broken or self.sock is None:
                raise TransportError(f"the lane to rank {self.dst} broke earlier; this group has failed")
            done = False
            try:
                with self.writing:
                    for data in buffers:
                        await loop.sock_sendall(self.sock, data)
                done = True
            except OSError as exc:
                raise PeerLost(
                    f"rank {self.dst} is unreachable: its data lane broke ({exc!r})", self.dst
                ) from None
            finally:
                if not done:
                    self.broken = True

    async def finish(self, *, wait: bool = True) -> None:
        """After the end-of-stream frame: close for writing and (``wait``) wait until the peer has read
        everything; otherwise the kernel still delivers what is written."""
        sock = self.sock
        if sock is None:
            return
        loop = asyncio.get_running_loop()
        try:
            sock.shutdown(socket.SHUT_WR)
            if wait:
                await _recv_exact(loop, sock, memoryview(bytearray(1)))  # returns at the peer's close
        except (OSError, PlaneError):
            pass
        finally:
            sock.close()
            self.sock = None

    def abandon(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
