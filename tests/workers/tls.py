"""Rank worker: collectives and send/recv with TLS on both planes; a plaintext call to a peer is refused."""

from __future__ import annotations

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
    other = world.runtime.membership.peers[1 - world.rank]
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


def main() -> None:
    run_rank(scenario)


if __name__ == "__main__":
    main()
