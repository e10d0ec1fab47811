"""Host lane framing, shared by the coordinator (``coordinator/host_lane.py``) and the host agent.

A frame is a 4-byte little-endian size, then one serialized protobuf message; nothing else is ever decoded.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError, Message

_SIZE = struct.Struct("<I")


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
    ``on_frame``, closes the connection; ``on_close`` then gets that error (or the connection's own, or None)."""

    def __init__(
        self,
        max_bytes: int,
        on_frame: Callable[[bytes], None],
        on_close: Callable[[BaseException | None], None],
    ) -> None:
        self.max_bytes, self.on_frame, self._on_close = max_bytes, on_frame, on_close
        self._buf = bytearray()
        self._error: BaseException | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

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
        if self._buf and self._error is None:
            self._error = LaneClosed("the connection ended inside a frame")
        self._on_close(self._error or exc)
