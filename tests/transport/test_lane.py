"""The raw data lane (TCP, or a Unix socket on the same machine): who may open one, what it carries, and what a
bad sender gets."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from paramplane.node.algorithms.ring import copy_into
from paramplane.node.direct_lane import DirectLane, polling
from paramplane.node.errors import PeerLost, TransportError
from paramplane.node.frame_template import varint
from paramplane.node.lane import (
    ABSTRACT_SOCKETS,
    UNIX_BUFFER_BYTES,
    LaneReader,
    LaneServer,
    LaneStream,
    opening_mac,
)
from paramplane.node.peer import PeerPlane
from paramplane.node.spec import OpSpec
from paramplane.node.transports.grpc import GrpcChannel
from paramplane.node.transports.p2p import _Line
from paramplane.protos import peer_pb2
from paramplane.protos.auth import token_metadata

TOKEN = "lane-test-token"
JOB = "job-lane"


async def bounded(aw: object, seconds: float = 10.0) -> object:
    return await asyncio.wait_for(aw, seconds)  # type: ignore[arg-type]


def _opening(src: int = 1, job: str = JOB, group: str = "g") -> bytes:
    return peer_pb2.StreamOpen(src=src, job_id=job, group=group).SerializeToString()


async def _raw_lane(port: int) -> tuple[socket.socket, bytes]:
    """A bare connection to a lane port and the server's nonce (the start of every handshake)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    await bounded(loop.sock_connect(sock, ("127.0.0.1", port)))
    nonce = await bounded(loop.sock_recv(sock, 16))
    assert isinstance(nonce, bytes)
    return sock, nonce


async def _closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` without accepting (the end, or a reset)."""
    try:
        return await bounded(asyncio.get_running_loop().sock_recv(sock, 1)) == b""
    except ConnectionResetError:
        return True


class _Recorder:
    def __init__(self) -> None:
        self.served: list[tuple[int, str, bool]] = []
        self.headers: list[bytes] = []
        self.done = asyncio.Event()

    async def opener(self, opening: peer_pb2.StreamOpen) -> str | None:
        return opening.group if opening.job_id == JOB else None

    async def serve(self, src: int, key: str, errors_only: bool, reader: LaneReader) -> None:
        self.served.append((src, key, errors_only))
        while (raw := await reader.read_header(1 << 16)) is not None:
            self.headers.append(raw)
        self.done.set()


async def _server() -> tuple[LaneServer, _Recorder]:
    rec = _Recorder()
    server = LaneServer(TOKEN, rec.opener, rec.serve)
    await server.start("127.0.0.1")
    return server, rec


async def test_an_authenticated_opening_is_served_and_carries_frames() -> None:
    server, rec = await _server()
    try:
        lane = LaneStream(0, "127.0.0.1", server.port)
        lane.opened = asyncio.ensure_future(lane.connect(TOKEN, _opening(group="g#err"), 5.0))
        header = peer_pb2.FrameHeader(group="g", seq=3).SerializeToString()
        await bounded(lane.send_frame([header]))
        await bounded(lane.finish())
        await bounded(rec.done.wait())
        assert rec.served == [(1, "g#err", True)]
        assert [peer_pb2.FrameHeader.FromString(h).seq for h in rec.headers] == [3]
    finally:
        await server.close()


@pytest.mark.parametrize(
    ("token", "opening"),
    [("wrong-token", _opening()), (None, _opening()), (TOKEN, _opening(job="other-job"))],
    ids=["wrong token", "no token", "other job"],
)
async def test_a_bad_opening_is_refused(token: str | None, opening: bytes) -> None:
    server, rec = await _server()
    try:
        lane = LaneStream(0, "127.0.0.1", server.port)
        with pytest.raises(PeerLost, match=r"refused|did not open"):
            await bounded(lane.connect(token, opening, 5.0))
        assert rec.served == []
    finally:
        await server.close()


async def test_garbage_and_oversized_openings_are_dropped_and_the_server_lives_on() -> None:
    server, rec = await _server()
    loop = asyncio.get_running_loop()
    rng = random.Random(7)
    try:
        for case in range(20):
            sock, nonce = await _raw_lane(server.port)
            if case % 2:
                payload = rng.randbytes(rng.randrange(1, 200))
            else:  # a claimed opening far beyond the limit
                payload = struct.pack("!I", 1 << 30) + opening_mac(TOKEN, nonce, b"")
            await loop.sock_sendall(sock, payload)
            sock.shutdown(socket.SHUT_WR)
            assert await _closed_by_server(sock)  # no acceptance byte
            sock.close()
        assert rec.served == []
        lane = LaneStream(0, "127.0.0.1", server.port)
        await bounded(lane.connect(TOKEN, _opening(), 5.0))
        assert rec.served == [(1, "g", False)]
        lane.abandon()
    finally:
        await server.close()


linux_only = pytest.mark.skipif(not ABSTRACT_SOCKETS, reason="abstract Unix sockets are Linux's")


@linux_only
async def test_a_lane_on_the_same_machine_takes_the_unix_socket_authenticated_alike() -> None:
    server, rec = await _server()
    try:
        assert server.path.startswith("paramplane-lane-") and server.port > 0
        lane = LaneStream(0, "127.0.0.1", server.port, server.path)
        lane.opened = asyncio.ensure_future(lane.connect(TOKEN, _opening(), 5.0))
        await bounded(lane.opened)
        assert lane.sock is not None and lane.sock.family == socket.AF_UNIX
        # its send buffer is widened where the system allows (Linux reports twice what was set)
        allowed = min(UNIX_BUFFER_BYTES, int(Path("/proc/sys/net/core/wmem_max").read_text()))
        assert lane.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 2 * allowed
        await bounded(lane.send_frame([peer_pb2.FrameHeader(group="g", seq=5).SerializeToString()]))
        await bounded(lane.finish())
        await bounded(rec.done.wait())
        assert [peer_pb2.FrameHeader.FromString(h).seq for h in rec.headers] == [5]
        stranger = LaneStream(0, "127.0.0.1", server.port, server.path)
        with pytest.raises(PeerLost, match=r"refused|did not open"):
            await bounded(stranger.connect("wrong-token", _opening(), 5.0))
        assert rec.served == [(1, "g", False)]
    finally:
        await server.close()


async def test_a_unix_name_not_reachable_from_here_falls_back_to_tcp() -> None:
    """A peer on another machine (or network namespace) advertises a name this one does not have."""
    server, rec = await _server()
    try:
        lane = LaneStream(0, "127.0.0.1", server.port, "paramplane-lane-on-another-machine")
        await bounded(lane.connect(TOKEN, _opening(), 5.0))
        assert lane.sock is not None and lane.sock.family == socket.AF_INET
        assert rec.served == [(1, "g", False)]
        lane.abandon()
    finally:
        await server.close()


async def _two_planes(unix_lane: bool = True) -> tuple[PeerPlane, PeerPlane]:
    a, b = PeerPlane(token=TOKEN, unix_lane=unix_lane), PeerPlane(token=TOKEN, unix_lane=unix_lane)
    addresses = {0: await a.start(), 1: await b.start()}
    a.configure(0, JOB, addresses)
    b.configure(1, JOB, addresses)
    return a, b


@pytest.mark.parametrize("unix_lane", [True, False], ids=["unix", "tcp"])
async def test_frames_between_two_planes_travel_on_a_lane(unix_lane: bool) -> None:
    a, b = await _two_planes(unix_lane)
    try:
        sender, receiver = GrpcChannel(a, "g", [0, 1], 0), GrpcChannel(b, "g", [0, 1], 1)
        spec = OpSpec("g", 1, "send/recv", "float32", (600_000,))
        data = np.arange(600_000, dtype=np.float32)  # 2.4 MB: three chunks
        got = np.zeros_like(data)

        await bounded(
            asyncio.gather(
                sender.send(1, spec, 0, data), receiver.recv(0, spec, 0, got.nbytes, copy_into(got, 0))
            )
        )
        assert np.array_equal(got, data)
        lane = await a.stream(1, "g")
        assert isinstance(lane, LaneStream) and lane.sock is not None
        unix = unix_lane and ABSTRACT_SOCKETS
        assert lane.sock.family == (socket.AF_UNIX if unix else socket.AF_INET)
    finally:
        await a.close(0.5)
        await b.close(0.5)


async def test_a_malformed_frame_on_a_lane_fails_the_key_with_a_transport_error() -> None:
    a, b = await _two_planes()
    loop = asyncio.get_running_loop()
    try:
        b.register_stream_key("g", frozenset({0, 1}))
        port = b.inbound.lane.port if b.inbound.lane is not None else 0
        sock, nonce = await _raw_lane(port)
        opening = _opening(src=0, group="g")
        await loop.sock_sendall(
            sock, struct.pack("!I", len(opening)) + opening + opening_mac(TOKEN, nonce, opening)
        )
        assert await bounded(loop.sock_recv(sock, 1)) == b"\x01"
        junk = b"\xff" * 40  # not a FrameHeader
        await loop.sock_sendall(sock, struct.pack("!I", len(junk)) + junk)
        inbox = b.inbox(0, "g")
        with pytest.raises(TransportError, match="malformed frame from rank 0"):
            await bounded(inbox.get())
        sock.close()
    finally:
        await a.close(0.5)
        await b.close(0.5)


async def _push_opening(plane_address: str, src: int, key: str) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(plane_address) as channel:
        push = channel.stream_unary("/paramplane.v1.Peer/Push")

        async def requests() -> Any:
            yield peer_pb2.StreamOpen(src=src, job_id=JOB, group=key).SerializeToString()

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await push(requests(), metadata=token_metadata(TOKEN), timeout=10)
        return info.value


async def test_streams_only_for_groups_this_rank_created_and_only_from_their_members() -> None:
    a, b = await _two_planes()
    try:
        b.inbound.admit_wait_s = 0.2
        address = b.me.addresses[1]
        b.register_stream_key("g", frozenset({1}))
        stranger = await bounded(_push_opening(address, 0, "g"))
        assert stranger.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "rank 0 is not a member of group 'g'" in (stranger.details() or "")
        unknown = await bounded(_push_opening(address, 0, "never-created"))
        assert unknown.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no group 'never-created'" in (unknown.details() or "")
        assert ("never-created" not in {k for _, k in b.inbound.inboxes}) and (
            (0, "g") not in b.inbound.inboxes
        )
        # The same refusals on a lane: the opening is not accepted.
        lane = LaneStream(1, "127.0.0.1", b.inbound.lane.port if b.inbound.lane is not None else 0)
        with pytest.raises(PeerLost, match="refused"):
            await bounded(lane.connect(TOKEN, _opening(src=0, group="never-created"), 5.0))
    finally:
        await a.close(0.5)
        await b.close(0.5)


async def test_a_receive_beyond_what_a_departed_peer_sent_fails_at_once() -> None:
    a, b = await _two_planes()
    try:
        sender, receiver = GrpcChannel(a, "g", [0, 1], 0), GrpcChannel(b, "g", [0, 1], 1)
        spec = OpSpec("g", 1, "send/recv", "float32", (4,))
        await bounded(sender.send(1, spec, 0, np.ones(4, np.float32)))
        await a.close(2.0)  # a finished its work and shut down cleanly
        got = np.zeros(4, np.float32)
        await bounded(receiver.recv(0, spec, 0, got.nbytes, copy_into(got, 0)))  # what it sent is readable
        assert got.tolist() == [1.0] * 4
        with pytest.raises(PeerLost, match="rank 0 shut down"):
            await bounded(
                receiver.recv(0, OpSpec("g", 2, "send/recv", "float32", (4,)), 0, 16, copy_into(got, 0)), 5
            )
    finally:
        await b.close(0.5)


async def test_after_a_sender_left_its_delivered_frames_are_read_then_receives_from_it_fail() -> None:
    """The runtime calls ``sender_left`` once a departed rank's flush grace has passed (gRPC streams' inboxes
    here; lanes in test_hung_ranks): what it delivered is still read, later receives from it and inboxes made
    for it afterwards fail with PeerLost naming it, and other ranks' inboxes are untouched."""
    plane = PeerPlane(token=TOKEN)
    delivered, other = plane.inbox(0, "g"), plane.inbox(2, "g")
    await delivered.put("frame")
    plane.sender_left(0)
    assert await bounded(delivered.get()) == "frame"
    with pytest.raises(PeerLost, match="rank 0 left the world without sending anything more on group 'g'"):
        await bounded(delivered.get())
    with pytest.raises(PeerLost, match="group 'h'") as later:
        await bounded(plane.inbox(0, "h").get())
    assert later.value.rank == 0
    await other.put("still here")
    assert await bounded(other.get()) == "still here" and other.error is None


async def test_an_authenticated_but_undecodable_opening_is_refused() -> None:
    server, rec = await _server()
    loop = asyncio.get_running_loop()
    try:
        sock, nonce = await _raw_lane(server.port)
        junk = b"\xff\xff\xff\xff"  # not a StreamOpen, with a valid MAC
        await loop.sock_sendall(sock, struct.pack("!I", len(junk)) + junk + opening_mac(TOKEN, nonce, junk))
        assert await _closed_by_server(sock)
        sock.close()
        assert rec.served == []
    finally:
        await server.close()


def _direct_lane() -> tuple[socket.socket, DirectLane]:
    """A parked lane over a socket pair: (the sender's end, the lane that reads the other)."""
    a, b = socket.socketpair()
    b.setblocking(False)
    lane = DirectLane(
        b,
        1,
        "g",
        chunk_bytes=1 << 16,
        max_header_bytes=1 << 20,
        parse=peer_pb2.FrameHeader.FromString,
        report=lambda kind, what: None,
    )
    return a, lane


def test_a_small_message_frame_is_valid_protobuf_and_read_without_parsing_when_it_matches() -> None:
    line = _Line()
    template = line.remember(
        np.dtype(np.float32), peer_pb2.FrameHeader(group="g", op="send", shape=[2], nbytes=8)
    )
    payload = np.arange(2, dtype=np.float32).tobytes()
    body = template.head + varint(300) + template.tail + payload
    assert peer_pb2.FrameHeader.FromString(body) == peer_pb2.FrameHeader(
        group="g", op="send", shape=[2], nbytes=8, seq=300, inline_payload=payload
    )
    a, lane = _direct_lane()
    other = peer_pb2.FrameHeader(
        group="g", op="send", shape=[3], nbytes=12, seq=301, inline_payload=bytes(12)
    )
    huge = template.head + varint(1 << 63) + template.tail + payload  # past int64: protobuf's to read
    # seq 1 written in 11 bytes: protobuf refuses a varint that long, and so must the lane.
    overlong = template.head + b"\x81" + b"\x80" * 9 + b"\x00" + template.tail + payload
    ended = peer_pb2.FrameHeader(group="g", end_of_stream=True)
    for frame in (body, other.SerializeToString(), huge, ended.SerializeToString()):
        a.sendall(struct.pack("!I", len(frame)) + frame)
    expected = (template.head, template.tail, template.header.nbytes)
    seq, view = lane.next_message(5.0, *expected)  # type: ignore[misc]
    assert (seq, bytes(view)) == (300, payload)
    assert lane.next_message(5.0, *expected) == other  # another shape: parsed, for the full checks
    assert lane.next_message(5.0, *expected) == peer_pb2.FrameHeader.FromString(huge)
    with pytest.raises(PeerLost, match="shut down"):
        lane.next_message(5.0, *expected)
    a.close()
    lane.close()
    a, lane = _direct_lane()
    a.sendall(struct.pack("!I", len(overlong)) + overlong)
    with pytest.raises(TransportError, match="malformed"):
        lane.next_message(5.0, *expected)
    a.close()
    lane.close()


@pytest.mark.parametrize("slice_s", [0.0, 1e-4])
def test_a_direct_lane_waits_its_timeout_reads_what_comes_and_fails_when_failed(slice_s: float) -> None:
    a, lane = _direct_lane()
    with polling(slice_s):
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            lane.next_item(0.2)
        assert 0.2 <= time.monotonic() - start < 20.0
        frame = peer_pb2.FrameHeader(group="g", seq=1, inline_payload=b"abc").SerializeToString()
        sender = threading.Thread(target=a.sendall, args=(struct.pack("!I", len(frame)) + frame,))
        sender.start()
        got = lane.next_item(30.0)
        sender.join(5.0)
        assert isinstance(got, peer_pb2.FrameHeader) and got.inline_payload == b"abc"
        failing = threading.Thread(target=lane.fail, args=(PeerLost("rank 1 is gone", 1),))
        start = time.monotonic()
        failing.start()
        with pytest.raises(PeerLost, match="gone"):
            lane.next_item(30.0)
        assert time.monotonic() - start < 20.0  # woken, not at the 30 s timeout
        failing.join(5.0)
        # A wait of up to a year (the longest timeout a setting takes) is cut to what poll() accepts, and
        # still ends when woken.
        lane.fail(PeerLost("rank 1 is gone", 1))
        lane._wait(time.monotonic() + 3e7)
    a.close()
    lane.close()


async def test_a_lane_waits_for_a_group_its_receiver_creates_after_the_greeting_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admitting a lane may wait for the receiver to create the group (as a gRPC stream does): only the
    greeting has the short handshake bound, so a group created later than that still gets the message."""
    import paramplane.node.lane as lane_module

    monkeypatch.setattr(lane_module, "HANDSHAKE_TIMEOUT_S", 0.2)
    a, b = await _two_planes()
    try:
        sender = GrpcChannel(a, "g", [0, 1], 0)  # registers the group on a only
        spec = OpSpec("g", 1, "send/recv", "float32", (4,))
        data = np.arange(4, dtype=np.float32)
        sending = asyncio.ensure_future(sender.send(1, spec, 0, data))
        deadline = time.monotonic() + 10
        while "g" not in b.inbound._key_waiters:  # the opening arrived and waits to be admitted
            assert time.monotonic() < deadline and not sending.done(), sending
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # well past the greeting bound before the group exists here
        receiver = GrpcChannel(b, "g", [0, 1], 1)
        got = np.zeros_like(data)
        await bounded(asyncio.gather(sending, receiver.recv(0, spec, 0, got.nbytes, copy_into(got, 0))))
        assert np.array_equal(got, data)
    finally:
        await a.close(0.5)
        await b.close(0.5)


async def test_the_lane_server_keeps_accepting_after_accept_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """An accept that fails (out of descriptors: EMFILE) is logged and retried, not the end of the server."""
    import errno

    import paramplane.node.lane as lane_module

    real, failures = lane_module._accept, [OSError(errno.EMFILE, "Too many open files")]

    async def flaky(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> socket.socket:
        if failures:
            raise failures.pop()
        return await real(loop, sock)

    monkeypatch.setattr(lane_module, "_accept", flaky)
    server, _ = await _server()
    try:
        sock, nonce = await bounded(_raw_lane(server.port))  # type: ignore[misc]
        assert len(nonce) == lane_module.NONCE_BYTES and not failures
        sock.close()
    finally:
        await server.close()


async def test_a_header_of_an_array_numpy_cannot_make_fails_the_key_with_a_transport_error() -> None:
    """0 x 2**62 x 2**62 announces 0 bytes (the size check passes) but numpy refuses the shape."""
    a, b = await _two_planes()
    try:
        for plane in (a, b):
            plane.register_stream_key("g", frozenset({0, 1}))
        header = peer_pb2.FrameHeader(
            group="g", seq=1, op="send/recv", dtype="float32", shape=[0, 2**62, 2**62], src=0, dst=1, nbytes=0
        )
        stream = await a.stream(1, "g")
        await stream.send_frame([header.SerializeToString()])
        spec = OpSpec("g", 1, "send/recv", "float32", (4,))
        with pytest.raises(TransportError, match="cannot be made"):
            await bounded(GrpcChannel(b, "g", [0, 1], 1).recv_array(0, spec, 0))
        assert b.failure("g") is not None
    finally:
        await a.close(0.5)
        await b.close(0.5)
