"""What both halves of the peer plane (``peer_inbound.py``, ``peer_outbound.py``) agree on: limits, the
frame header check, TLS material and who this rank is."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from paramplane.protos import peer_pb2

SERVICE = "paramplane.v1.Peer"
PUSH_METHOD = f"/{SERVICE}/Push"
HELLO_METHOD = f"/{SERVICE}/Hello"
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
# A stream key with this suffix carries only error frames of its group.
ERROR_SUFFIX = "#err"


class Malformed(Exception):
    """A frame that does not parse, or a message over the size limit."""

    def __init__(self, message: str, *, oversized: bool = False) -> None:
        super().__init__(message)
        self.oversized = oversized


def parse_header(message: bytes) -> peer_pb2.FrameHeader:
    try:
        header = peer_pb2.FrameHeader.FromString(message)
    except Exception as exc:
        raise Malformed(f"undecodable frame header ({len(message)} bytes)") from exc
    payload = len(header.inline_payload)
    if (
        header.nbytes < 0
        or header.num_chunks < 0
        or header.num_chunks * CHUNK_BYTES + payload < header.nbytes
    ):
        raise Malformed(f"frame header with nbytes={header.nbytes}, num_chunks={header.num_chunks}")
    return header


@dataclass(frozen=True)
class TlsConfig:
    """PEM material for the data plane; every rank serves with its cert and trusts ``root_cert``."""

    cert: bytes
    """This rank's certificate."""
    key: bytes = field(repr=False)  # the private key: never in a repr or a traceback's locals
    """Its private key."""
    root_cert: bytes
    """The CA every rank's certificate must be signed by."""


@dataclass
class PlaneIdentity:
    """This rank in its world, as both halves of the plane see it (set by ``PeerPlane.configure``)."""

    rank: int = -1
    """This rank (-1 until the world formed)."""
    job_id: str = ""
    """The world's job id; streams of another job are refused."""
    addresses: dict[int, str] = field(default_factory=dict)
    """Every rank's data-plane address."""
    lost: set[int] = field(default_factory=set)
    """Ranks known dead: no goodbye goes to them."""
    left: set[int] = field(default_factory=set)
    """Ranks that left the world (after delivering what they sent): nothing more goes to them either."""
    closing: bool = False
    """The plane is shutting down."""
    configured: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the world formed: a peer that learned it first waits on this before its stream is admitted."""

    def gone(self, rank: int) -> bool:
        """Rank ``rank`` is dead or left the world: it reads nothing more."""
        return rank in self.lost or rank in self.left


def consume_exception(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a frame whose sender gave up: its error was raised there, or is moot
