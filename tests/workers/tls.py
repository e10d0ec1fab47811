"""Rank worker: collectives and send/recv with TLS on both planes; a plaintext call to a peer is refused."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grpc
import numpy as np
from _common import Report, run_rank

import paramplane as pp
from paramplane.protos import peer_pb2
from paramplane.protos.auth import token_metadata


def scenario(world: pp.World, rep: Report) -> None:
    g, n = world.group, world.world_size
    x = np.full(3 << 18, world.rank + 1.0, np.float32)  # 3 MiB: chunked frames over TLS
    g.all_reduce(x)
    rep.equal("all_reduce over TLS", x, np.full(3 << 18, n * (n + 1) / 2, np.float32))
    # Point-to-point over TLS: gRPC streams and inboxes (lanes are plaintext, so they are off). After the
    # first message an inbox exists and a blocking receive reads it on this thread.
    peer = 1 - world.rank
    for i in range(3):
        for size in (5, 300_000):
            work = g.send(np.arange(size, dtype=np.float64) + world.rank + i, peer, async_op=True)
            got = g.recv(np.empty(size), peer)
            work.wait(30)
            rep.equal(
                f"p2p over TLS, round {i}, {size} floats", got, np.arange(size, dtype=np.float64) + peer + i
            )
    # The frames rode gRPC streams under TLS: no lane server here, no lane link opened, and the peer's Hello
    # (over TLS) offers no lane either.
    plane = world.runtime.plane
    rep.check("no lane served under TLS", not plane.serves_lanes)
    kinds = plane.outbound_kinds()
    rep.check("every link is a gRPC stream", kinds == {"grpc-stream"}, str(kinds))
    other = world.runtime.membership.peers[1 - world.rank]
    creds = grpc.ssl_channel_credentials(root_certificates=Path(os.environ["PARAMPLANE_TLS_CA"]).read_bytes())
    with grpc.secure_channel(other.address, creds) as channel:
        hello = channel.unary_unary(
            "/paramplane.v1.Peer/Hello",
            request_serializer=peer_pb2.HelloRequest.SerializeToString,
            response_deserializer=peer_pb2.HelloResponse.FromString,
        )
        reply = hello(peer_pb2.HelloRequest(rank=world.rank), metadata=token_metadata(None), timeout=10)
        rep.check(
            "the peer offers no lane under TLS", reply.lane_port == 0 and not reply.lane_path, str(reply)
        )
    with grpc.insecure_channel(other.address) as channel:
        hello = channel.unary_unary(
            "/paramplane.v1.Peer/Hello",
            request_serializer=peer_pb2.HelloRequest.SerializeToString,
            response_deserializer=peer_pb2.HelloResponse.FromString,
        )
        try:
            hello(peer_pb2.HelloRequest(rank=world.rank), metadata=token_metadata(None), timeout=5)
            rep.check("plaintext call refused", False, "answered")
        except grpc.RpcError as err:
            rep.check("plaintext call refused", err.code() == grpc.StatusCode.UNAVAILABLE, str(err.code()))
    g.barrier()


def other_ca(world: pp.World, rep: Report) -> None:
    """Rank 1 serves with a certificate from a CA rank 0 does not trust: rank 0 refuses to send to it, and
    the collective fails on both ranks with a PlaneError (no hang, no plaintext fallback)."""
    try:
        world.group.all_reduce(np.ones(1024, np.float32))
        rep.check("the collective with an untrusted peer fails", False, "it succeeded")
    except pp.PlaneError as exc:
        rep.values.update(error=type(exc).__name__, message=str(exc))
        rep.check("the collective with an untrusted peer fails", True)


def main() -> None:
    run_rank(other_ca if sys.argv[1:] == ["other_ca"] else scenario)


if __name__ == "__main__":
    main()
