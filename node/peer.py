"""The peer plane: this rank's data-plane gRPC server, its outbound links and its inboxes.

Frames travel by default on lanes (``lane.py``): raw sockets (an abstract Unix socket on one machine, TCP
between hosts) whose port each rank's gRPC ``Hello`` names and which open with an HMAC of the job token.
Under TLS, or with ``PARAMPLANE_TCP_LANE=0``, the same frames ride long-lived gRPC client streams of raw
bytes (identity serializers). Either way a link's first message is an encoded ``StreamOpen`` naming the
sender and the stream key (one link per process group and direction, so groups never block one another);
after it the sender writes, for every frame, an encoded ``FrameHeader`` and then the raw payload. Only
headers are parsed; nothing is unpickled.

``PeerPlane`` joins two halves: ``peer_inbound.Inbound`` (the server, the stream-key registry, the inboxes
and failure fan-out) and ``peer_outbound.Outbound`` (dialing lanes and gRPC streams to peers, goodbyes);
``peer_wire`` holds what both agree on.
"""

from __future__ import annotations

import asyncio

from paramplane.node.direct_lane import DirectLanes
from paramplane.node.errors import PlaneError
from paramplane.node.inbox import Inbox
from paramplane.node.lane import LaneStream
from paramplane.node.peer_inbound import Inbound
from paramplane.node.peer_outbound import Outbound, OutStream
from paramplane.node.peer_wire import CHUNK_BYTES, ERROR_SUFFIX, PlaneIdentity, TlsConfig

__all__ = ["CHUNK_BYTES", "ERROR_SUFFIX", "OutStream", "PeerPlane", "TlsConfig"]


class PeerPlane:
    """The data-plane server, the outbound links and the inboxes of one rank."""

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
        self._bind_host = bind_host
        self._advertise_host = advertise_host or bind_host
        self._lane_wanted = lane and tls is None
        self.me = PlaneIdentity()
        self.inbound = Inbound(token=token, me=self.me, tls=tls, lane=self._lane_wanted, unix_lane=unix_lane)
        self.outbound = Outbound(
            token=token,
            me=self.me,
            tls=tls,
            dial_lanes=self._lane_wanted,
            failure=self.inbound.failure,
            direct_keys=self.inbound.direct.keys,
        )

    @property
    def rank(self) -> int:
        return self.me.rank

    @property
    def job_id(self) -> str:
        return self.me.job_id

    @property
    def lost(self) -> set[int]:
        """Ranks known dead."""
        return self.me.lost

    @property
    def direct(self) -> DirectLanes:
        """The point-to-point lanes parked for receiving threads (``node/direct_lane.py``)."""
        return self.inbound.direct

    @property
    def frames_ride(self) -> str:
        """How frames to other ranks travel: ``"lane"`` (raw sockets, Unix or TCP; the default) or
        ``"grpc-stream"`` (under TLS or with ``PARAMPLANE_TCP_LANE=0``). Traces label that traffic with it."""
        return "lane" if self._lane_wanted else "grpc-stream"

    @property
    def serves_lanes(self) -> bool:
        """Whether this rank listens for lanes (raw sockets); never under TLS, whose frames ride gRPC streams."""
        return self.inbound.lane is not None

    def outbound_kinds(self) -> set[str]:
        """How this rank's open outbound links move frames: ``"lane-unix"`` / ``"lane-tcp"`` (a raw socket) or
        ``"grpc-stream"``."""
        return self.outbound.kinds()

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> str:
        """Start the server on an ephemeral port; returns the address to advertise."""
        port = await self.inbound.start(self._bind_host)
        return f"{self._advertise_host}:{port}"

    def configure(self, rank: int, job_id: str, addresses: dict[int, str]) -> None:
        """Learn this rank's identity and every peer's address (after the world formed)."""
        self.me.rank = rank
        self.me.job_id = job_id
        self.me.addresses = dict(addresses)
        self.me.configured.set()

    def register_stream_key(self, key: str, members: frozenset[int], *, direct: bool = False) -> None:
        """Declare which ranks talk on ``key``: only they may open streams for it here, and a lost peer
        fails exactly the keys it belongs to. With ``direct`` its lanes are parked for receiving threads to
        read (``node/direct_lane.py``). Callable from any thread; it takes effect on the loop."""
        self.inbound.register_stream_key(key, members, direct=direct)

    def telling(self, task: asyncio.Future[None]) -> None:
        """Keep ``task`` (an error frame to another rank) until it is done: ``told`` waits for it."""
        self.outbound.telling(task)

    async def told(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the error frames on their way have gone out: a rank that leaves
        first would reach its peers as a departure (PeerLost) instead of the error it found."""
        await self.outbound.told(timeout_s)

    async def flush(self, grace: float = 1.0) -> None:
        """Finish every outbound link, delivering what was written (each bounded by ``grace``); the server
        still serves (peers flushing to this rank finish too). No send can start after it."""
        self.me.closing = True
        await self.outbound.close(grace)

    async def close(self, grace: float = 1.0) -> None:
        """``flush``, then stop the server."""
        await self.flush(grace)
        await self.inbound.stop(grace)

    @property
    def closing(self) -> bool:
        """The plane is shutting down: its streams are finishing and take no more frames."""
        return self.me.closing

    # -- failures --------------------------------------------------------------------------------
    def failure(self, key: str) -> PlaneError | None:
        return self.inbound.failure(key)

    def told_by(self, rank: int) -> PlaneError | None:
        """The failure rank ``rank`` said, in an error frame, made it stop (None if it said none)."""
        return self.inbound.told.get(rank)

    def fail_key(self, key: str, exc: PlaneError, *, lost: int = -1) -> None:
        """Fail every inbox of stream key ``key``: its pending and later receives raise ``exc``.

        When rank ``lost`` died, frames it delivered before dying stay readable.
        """
        self.inbound.fail_key(key, exc, lost=lost)

    def fail_all(self, exc: PlaneError) -> None:
        self.inbound.fail_all(exc)

    def peer_lost(self, src: int, why: str) -> None:
        self.inbound.peer_lost(src, why)

    def peer_left(self, src: int) -> None:
        """Rank ``src`` left the world (on the loop): no error frame or goodbye goes to it any more, and this
        plane's shutdown does not wait for it to read."""
        self.me.left.add(src)

    def sender_left(self, src: int) -> None:
        """Rank ``src`` left the world and its plane has flushed what it sent (on the loop): a receive from it
        reads what it delivered, then fails with PeerLost instead of waiting out the group's timeout."""
        self.inbound.sender_left(src)

    # -- receiving -------------------------------------------------------------------------------
    def inbox(self, src: int, key: str) -> Inbox:
        return self.inbound.inbox(src, key)

    def is_direct(self, key: str) -> bool:
        """Whether frames on ``key`` come on lanes its receiving threads read (not through an inbox)."""
        return self.inbound.lane is not None and key in self.inbound.direct.keys

    def existing_inbox(self, src: int, key: str) -> Inbox | None:
        """The inbox of (``src``, ``key``) if one was made (from any thread; ``inbox`` makes them, on the loop)."""
        return self.inbound.inboxes.get((src, key))

    # -- sending ---------------------------------------------------------------------------------
    def ready_lane(self, dst: int, key: str) -> LaneStream | None:
        """``dst``'s open lane for ``key`` (from any thread), or None: not opened yet, a gRPC stream (TLS),
        broken, failed, or the plane is closing."""
        return self.outbound.ready_lane(dst, key)

    async def stream(self, dst: int, key: str) -> OutStream | LaneStream:
        """The outbound link to ``dst`` for ``key``, opened on first use."""
        return await self.outbound.stream(dst, key)
