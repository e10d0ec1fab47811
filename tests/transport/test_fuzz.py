"""Fuzzing the coordinator's and a rank's ports: random bytes, mutated protobufs, bad tokens, garbage on
the TCP lanes. Every call ends with a proper status within its deadline (never UNKNOWN, the mark of an
unhandled exception), the servers stay up, and a world formed afterwards works."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
from collections import Counter
from typing import Any

import grpc
import numpy as np

from paramplane.benchmarks._fuzz import COORD, MESSAGES, UNARY, call, mutated
from paramplane.coordinator.server import CoordinatorConfig, CoordinatorThread
from paramplane.node.algorithms.ring import copy_into
from paramplane.node.peer import PeerPlane
from paramplane.node.spec import OpSpec
from paramplane.node.transports.grpc import GrpcChannel
from paramplane.protos import coordinator_pb2, peer_pb2
from paramplane.protos.auth import token_metadata

TOKEN = "fuzz-token"
NUM_COORDINATOR_CALLS = 2000
NUM_PEER_STREAMS = 400  # each: an opening and three fuzzed frames, then a fuzzed Hello
NUM_LANE_CONNECTIONS = 300
SEED = 20261122


def test_coordinator_survives_random_and_mutated_requests() -> None:
    rng = random.Random(SEED)
    codes: Counter[str] = Counter()
    config = CoordinatorConfig(host="127.0.0.1", port=0, world_size=2, token=TOKEN, join_timeout_s=5)
    with CoordinatorThread(config) as coord, grpc.insecure_channel(coord.address) as channel:
        auth = token_metadata(TOKEN)
        for i in range(NUM_COORDINATOR_CALLS):
            method = rng.choice(UNARY)
            payload = (
                mutated(rng, MESSAGES[method])
                if i % 2 and method in MESSAGES
                else rng.randbytes(rng.randrange(0, 300))
            )
            # A well-formed Join may wait for a world: a short deadline keeps the run quick.
            codes[call(channel, method, payload, auth, timeout=1 if method == "Join" else 10).name] += 1
        for method in ("Barrier", "KVGet"):
            for _ in range(10):
                codes[call(channel, method, rng.randbytes(rng.randrange(0, 40)), auth, timeout=2).name] += 1
        stream = channel.unary_stream(COORD + "Watch")
        for _ in range(10):
            try:
                for _event in stream(rng.randbytes(rng.randrange(0, 40)), metadata=auth, timeout=1):
                    pass
            except grpc.RpcError as err:
                assert err.code() != grpc.StatusCode.UNKNOWN, err.details()  # type: ignore[attr-defined]
        # Still serving: a well-formed Status answers.
        status = channel.unary_unary(
            COORD + "Status",
            request_serializer=coordinator_pb2.StatusRequest.SerializeToString,
            response_deserializer=coordinator_pb2.StatusResponse.FromString,
        )
        assert status(coordinator_pb2.StatusRequest(), metadata=auth, timeout=10) is not None
    assert len(codes) >= 2, codes  # the malformed calls reached different checks, not one blanket refusal


def test_bad_tokens_are_refused_everywhere_and_a_world_forms_afterwards() -> None:
    rng = random.Random(SEED + 1)
    config = CoordinatorConfig(host="127.0.0.1", port=0, world_size=2, token=TOKEN, join_timeout_s=60)
    with CoordinatorThread(config) as coord:
        with grpc.insecure_channel(coord.address) as channel:
            for i in range(120):
                method = rng.choice(UNARY)
                payload = mutated(rng, MESSAGES[method]) if method in MESSAGES else rng.randbytes(50)
                metadata = () if i % 2 else token_metadata(TOKEN + rng.choice(["x", "-1", "0"]))
                assert call(channel, method, payload, metadata, timeout=10) == grpc.StatusCode.UNAUTHENTICATED
        code = (
            "import numpy as np, paramplane as pp\n"
            "with pp.init() as w:\n"
            "    x = np.full(3, w.rank + 1.0); w.group.all_reduce(x)\n"
            "    assert x.tolist() == [3.0] * 3, x\n"
        )
        env = dict(
            os.environ,
            PARAMPLANE_COORDINATOR=coord.address,
            PARAMPLANE_WORLD_SIZE="2",
            PARAMPLANE_TOKEN=TOKEN,
            PARAMPLANE_TIMEOUT="30",
        )
        procs = [
            subprocess.Popen([sys.executable, "-c", code], env=dict(env, PARAMPLANE_RANK=str(r)))
            for r in (0, 1)
        ]
        try:
            assert [p.wait(timeout=90) for p in procs] == [0, 0]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)


async def _planes() -> tuple[PeerPlane, PeerPlane]:
    a, b = PeerPlane(token=TOKEN), PeerPlane(token=TOKEN)
    addresses = {0: await a.start(), 1: await b.start()}
    a.configure(0, "job-fuzz", addresses)
    b.configure(1, "job-fuzz", addresses)
    a.inbound.admit_wait_s = b.inbound.admit_wait_s = 0.1
    return a, b


def _frame_variants(rng: random.Random) -> list[bytes]:
    """Random bytes, mutated frame headers (absurd shapes, sizes, chunk counts) and oversized messages."""
    header = peer_pb2.FrameHeader(group="g", seq=1, op="all_reduce", dtype="float32", shape=[4], nbytes=16)
    out = [rng.randbytes(rng.randrange(1, 200)), header.SerializeToString()]
    for _ in range(4):
        h = peer_pb2.FrameHeader()
        h.CopyFrom(header)
        h.nbytes = rng.choice([-1, 0, 2**40, 17])
        h.num_chunks = rng.choice([-5, 0, 3, 10**6])
        h.shape[:] = [rng.choice([-1, 0, 2**31 - 1])]
        h.dtype = rng.choice(["float32", "pickle", ""])
        out.append(h.SerializeToString())
    out.append(b"\x00" * (2 << 20))  # over the 1 MiB + header message limit
    return out


async def test_peer_ports_survive_malformed_streams_and_still_carry_frames() -> None:
    rng = random.Random(SEED + 2)
    a, b = await _planes()
    loop = asyncio.get_running_loop()
    try:
        sender, receiver = GrpcChannel(a, "g", [0, 1], 0), GrpcChannel(b, "g", [0, 1], 1)
        address = b.me.addresses[1]
        async with grpc.aio.insecure_channel(
            address, options=[("grpc.max_send_message_length", 8 << 20)]
        ) as ch:
            push = ch.stream_unary("/paramplane.v1.Peer/Push")
            hello = ch.unary_unary("/paramplane.v1.Peer/Hello")
            for i in range(NUM_PEER_STREAMS):
                opening = rng.choice(
                    [
                        rng.randbytes(rng.randrange(0, 60)),
                        peer_pb2.StreamOpen(
                            src=rng.choice([-1, 5, 0]), job_id="job-fuzz", group="g"
                        ).SerializeToString(),
                        peer_pb2.StreamOpen(src=0, job_id="other", group="g").SerializeToString(),
                        peer_pb2.StreamOpen(
                            src=0, job_id="job-fuzz", group=rng.choice(["nope", "g#err", "#bye"])
                        ).SerializeToString(),
                    ]
                )
                frames = [opening, *rng.sample(_frame_variants(rng), 3)]

                async def requests(frames: list[bytes] = frames) -> Any:
                    for f in frames:
                        yield f

                metadata = token_metadata(TOKEN) if i % 5 else token_metadata("wrong")
                try:
                    await asyncio.wait_for(push(requests(), metadata=metadata, timeout=5), 10)
                except grpc.aio.AioRpcError as err:
                    assert err.code() != grpc.StatusCode.UNKNOWN, err.details()
                try:
                    await hello(
                        rng.randbytes(rng.randrange(0, 30)), metadata=token_metadata(TOKEN), timeout=5
                    )
                except grpc.aio.AioRpcError as err:
                    assert err.code() != grpc.StatusCode.UNKNOWN, err.details()
        # Raw garbage on the lane port.
        port = b.inbound.lane.port if b.inbound.lane is not None else 0
        for _ in range(NUM_LANE_CONNECTIONS):
            sock = socket.socket()
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 5)
            try:
                await loop.sock_sendall(sock, rng.randbytes(rng.randrange(0, 5000)))
            except OSError:
                pass
            sock.close()
        # Inboxes exist only for the registered key (fuzzed frames on it failed it); nothing else was made.
        assert {k for _, k in b.inbound.inboxes} <= {"g", "#bye"}
        # A fresh group between the same planes still works.
        fresh_a, fresh_b = GrpcChannel(a, "h", [0, 1], 0), GrpcChannel(b, "h", [0, 1], 1)
        spec = OpSpec("h", 1, "send/recv", "float32", (300_000,))
        data = np.arange(300_000, dtype=np.float32)
        got = np.zeros_like(data)
        await asyncio.wait_for(
            asyncio.gather(
                fresh_a.send(1, spec, 0, data), fresh_b.recv(0, spec, 0, got.nbytes, copy_into(got, 0))
            ),
            10,
        )
        assert np.array_equal(got, data)
        del sender, receiver
    finally:
        await a.close(0.5)
        await b.close(0.5)
