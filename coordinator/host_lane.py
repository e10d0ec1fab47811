"""The host lane: an agent's ``HostCalls`` stream on a plain TCP connection instead of gRPC.

The same messages (``HostCall`` in, ``HostAnswer`` out), each a frame: a 4-byte little-endian size, then the
serialized message. The first frame is a ``HostLaneHello`` (the job token, the agent's session; at most
``HELLO_BYTES``); the coordinator compares the token in constant time before it decodes any call, then serves
the connection as a ``HostCalls`` stream (``HostStreams``: the session's calls, answers, resends). A wrong token, a frame over the size limit, bytes
that do not decode or a hello that does not come within ``HELLO_TIMEOUT_S`` close the connection; nothing else
is affected.

Why: a barrier release is one answer per host, and on grpc aio each answer written crosses three threads on
each side (the event engine, the completion queue, the event loop); on a socket the event loop writes it
itself. The agent learns the lane's port from the gRPC stream's acknowledgement and keeps using gRPC when the
lane cannot be reached (a firewall, a port not published). Not offered with TLS (the lane is not encrypted).
"""

from __future__ import annotations

import logging

from paramplane.coordinator.host_stream import HostStreams, Session
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos.host_lane import (
    HELLO_BYTES,
    HELLO_TIMEOUT_S,
    FrameProtocol,
    FrameServer,
    LaneClosed,
    check_hello,
    decode,
)
from paramplane.protos.net import host_port

log = logging.getLogger("paramplane.coordinator")


class _Context:
    """What ``HostStreams`` uses of a stream's context, on a lane connection."""

    def __init__(self, conn: FrameProtocol) -> None:
        self._conn = conn

    def send(self, answer: pb.HostAnswer) -> None:
        self._conn.write(answer)

    async def write(self, answer: pb.HostAnswer) -> None:
        self._conn.write(answer)


class _Connection:
    """One agent's lane: the hello, then its calls, each taken as it is read."""

    def __init__(self, lanes: HostLanes) -> None:
        self._lanes = lanes
        self.conn = FrameProtocol(HELLO_BYTES, self._frame, self._closed, HELLO_TIMEOUT_S)
        self._context = _Context(self.conn)
        self._session: Session | None = None

    def _frame(self, data: bytes) -> None:
        hosts = self._lanes.hosts
        if self._session is None:
            hello = check_hello(data, self._lanes.token)
            if not hello.session:
                raise LaneClosed("a hello without its session")
            self.conn.greeted()
            self.conn.max_bytes = self._lanes.max_message_bytes
            self._session = hosts.open_lane(hello.session, self._context)
        elif not hosts.take(self._session, self._context, decode(pb.HostCall(), data)):
            self.conn.close()  # the agent opened a newer stream for the session

    def _closed(self, error: BaseException | None) -> None:
        self._lanes.conns.discard(self.conn)
        if isinstance(error, LaneClosed):
            log.warning("host lane from %s closed: %s", self._peer(), error)
        if self._session is not None:
            self._lanes.hosts.detach(self._session, self._context)

    def _peer(self) -> object:
        return self.conn.transport.get_extra_info("peername") if self.conn.transport is not None else None


class HostLanes:
    """The coordinator's lane listener; its connections are served by ``hosts``."""

    def __init__(self, hosts: HostStreams, token: str | None, max_message_bytes: int) -> None:
        self.hosts, self.token, self.max_message_bytes = hosts, token, max_message_bytes
        self._frames = FrameServer(lambda: _Connection(self).conn)
        self.conns = self._frames.conns
        self.port = 0
        """The bound port (0 until started)."""

    async def start(self, host: str, port: int) -> None:
        try:
            self.port = await self._frames.start_tcp(host, port)
        except OSError as e:
            raise OSError(
                f"cannot bind the host lane to {host_port(host, port)}: is the port in use? ({e})"
            ) from e

    async def stop(self) -> None:
        await self._frames.stop()
