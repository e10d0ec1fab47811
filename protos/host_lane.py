"""Host lane framing, shared by the coordinator (``coordinator/host_lane.py``) and the host agent.

A frame is a 4-byte little-endian size, then one serialized protobuf message; nothing else is ever decoded.
"""

from __future__ import annotations

import asyncio
import hmac
import struct
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError, Message

from paramplane.protos import coordinator_pb2 as pb

_SIZE = struct.Struct("<I")
HELLO_BYTES = 4096
"""The largest hello (a token and a session)."""
HELLO_TIMEOUT_S = 10.0
"""How long a new connection to a lane may take to send its hello."""


class LaneClosed(Exception):
    """The lane's peer broke the framing or the rules: the connection is closed."""


def frame(message: Message) -> bytes:
    """``message`` as one lane frame."""
    body = message.SerializeToString()
    return _SIZE.pack(len(body)) + body


def decode(message: Message, data: bytes) -> Any:
    try:
        message.ParseFromString(data)
    except DecodeError:
        raise LaneClosed(f"a frame that is not a {type(message).__name__}") from None
    return message


class FrameProtocol(asyncio.Protocol):
    """A lane connection: each whole frame that comes in is handed to ``on_frame`` as it is read (no task, no
    extra turn of the event loop); ``write`` sends one. A frame over ``max_bytes``, or ``LaneClosed`` raised by
    ``on_frame``, closes the connection; ``on_close`` then gets that error (or the connection's own, or None).
    With ``hello_s``, a connection that is not ``greeted`` within that many seconds of opening is closed (a
    listener's side: a peer that connects and says nothing holds nothing for long)."""

    def __init__(
        self,
        max_bytes: int,
        on_frame: Callable[[bytes], None],
        on_close: Callable[[BaseException | None], None],
        hello_s: float | None = None,
    ) -> None:
        self.max_bytes, self.on_frame, self._on_close = max_bytes, on_frame, on_close
        self._buf = bytearray()
        self._error: BaseException | None = None
        self.transport: asyncio.Transport | None = None
        self._hello_s = hello_s
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self._hello_s is not None:
            error = LaneClosed(f"no hello within {self._hello_s:g} s")
            self._hello_timer = asyncio.get_running_loop().call_later(self._hello_s, self.fail, error)

    def greeted(self) -> None:
        """The hello came: no deadline any more."""
        if self._hello_timer is not None:
            self._hello_timer.cancel()

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start = 0
        while len(buf) - start >= _SIZE.size and self._error is None:
            (size,) = _SIZE.unpack_from(buf, start)
            if size > self.max_bytes:
                self.fail(LaneClosed(f"a frame of {size} bytes, over the limit of {self.max_bytes}"))
                return
            end = start + _SIZE.size + size
            if len(buf) < end:
                break
            body = bytes(buf[start + _SIZE.size : end])
            start = end
            try:
                self.on_frame(body)
            except LaneClosed as e:
                self.fail(e)
                return
        del buf[:start]

    def write(self, message: Message) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the host lane is closed")
        self.transport.write(frame(message))

    def fail(self, error: BaseException) -> None:
        """Close the connection for ``error`` (what ``on_close`` gets)."""
        if self._error is None:
            self._error = error
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.greeted()
        if self._buf and self._error is None:
            self._error = LaneClosed("the connection ended inside a frame")
        self._on_close(self._error or exc)


def check_hello(data: bytes, token: str | None) -> pb.HostLaneHello:
    """The ``HostLaneHello`` in ``data`` if it carries ``token`` (compared in constant time; None: any)."""
    hello: pb.HostLaneHello = decode(pb.HostLaneHello(), data)
    if token is not None and not hmac.compare_digest(hello.token.encode(), token.encode()):
        raise LaneClosed("a wrong or missing token")
    return hello


class FrameServer:
    """A lane listener: ``connection()`` makes each accepted connection's protocol; ``stop`` closes them all.
    A connection leaves ``conns`` when its owner discards it (on close)."""

    def __init__(self, connection: Callable[[], FrameProtocol]) -> None:
        self._connection = connection
        self._server: asyncio.AbstractServer | None = None
        self.conns: set[FrameProtocol] = set()

    async def start_tcp(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free one); answers the bound port."""
        server = await asyncio.get_running_loop().create_server(self._accept, host, port)
        self._server = server
        return int(server.sockets[0].getsockname()[1])

    async def start_unix(self, path: str) -> None:
        self._server = await asyncio.get_running_loop().create_unix_server(self._accept, path)

    def _accept(self) -> FrameProtocol:
        conn = self._connection()
        self.conns.add(conn)
        return conn

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self.conns):
                conn.close()
            await self._server.wait_closed()
