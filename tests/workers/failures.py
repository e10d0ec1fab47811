"""Rank worker for tests/transport/test_collective_failures.py; the scenario is argv[1].

- ``errors`` (2 ranks): bad input, Work.wait timeout, mismatch, group timeout, ops after shutdown.
- ``peer-lost``: the last rank dies with os._exit in the middle of a large all_reduce.
- ``sender-dies``: the last rank dies while the others wait to receive from it.
- ``malformed`` (2 ranks, with a token): rank 1 attacks rank 0's peer server directly.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import grpc
import numpy as np
from _common import Report, run_rank

import paramplane as pp
from paramplane.protos import peer_pb2
from paramplane.protos.auth import token_metadata

KV_TIMEOUT = 30.0


def errors(world: pp.World, rep: Report) -> None:
    """Checks are named "<topic>: ..." so that tests can look at one topic each."""
    me = world.rank
    g = world.group
    stuck_group = world.new_group([0, 1], timeout=30)
    mismatch_group = world.new_group([0, 1])
    a2a_group = world.new_group([0, 1])
    fresh_group = world.new_group([0, 1])
    uneven_group = world.new_group([0, 1])
    assert stuck_group is not None and mismatch_group is not None and fresh_group is not None
    assert a2a_group is not None

    # Bad input on rank 0 alone: ValueError before any communication, so the group stays in step.
    if me == 0:
        base = np.arange(10, dtype=np.float32)
        rep.raises("input: non-contiguous", ValueError, lambda: g.all_reduce(base[::2]), "contiguous")
        ro = np.arange(4, dtype=np.float32)
        ro.flags.writeable = False
        rep.raises("input: read-only", ValueError, lambda: g.all_reduce(ro), "read-only")
        rep.raises("input: read-only broadcast", ValueError, lambda: g.broadcast(ro, src=0), "read-only")
        rep.raises("input: unknown op", ValueError, lambda: g.all_reduce(np.ones(3), "avg"), "avg")
        rep.raises(
            "input: unknown op reduce_scatter", ValueError, lambda: g.reduce_scatter(np.ones(3), "median")
        )
        rep.raises("input: bad src", ValueError, lambda: g.broadcast(np.ones(3), src=5))
        rep.raises("input: non-array", ValueError, lambda: g.all_reduce([1.0, 2.0]))
        rep.raises(
            "input: all_to_all of 3 rows over 2 ranks", ValueError, lambda: g.all_to_all(np.ones(3)), "equal"
        )
    x = np.full(3, me + 1.0)
    g.all_reduce(x)
    rep.equal("input: group still in step after bad input", x, np.full(3, 3.0))

    # Work.wait(timeout) on an op that cannot finish yet: CollectiveTimeout, and it keeps running.
    y = np.full(5, me + 1, np.int64)
    if me == 0:
        w = stuck_group.all_reduce(y, async_op=True)
        rep.raises("work: wait timeout", pp.CollectiveTimeout, lambda: w.wait(0.3), "0.3")
        rep.check("work: stuck op still running", not w.is_completed() and w.exception() is None)
        world.kv.set("stuck/go", b"1")
        rep.check("work: stuck op finishes later", w.wait(30) is y)
    else:
        world.kv.get("stuck/go", wait=True, timeout=KV_TIMEOUT)
        stuck_group.all_reduce(y)
    rep.equal("work: stuck op result", y, np.full(5, 3, np.int64))

    # Mismatched shapes: CollectiveMismatch on both ranks naming both shapes; the group stays failed.
    # Rank 1 issues first, so rank 0 usually finds the mismatch before it has sent anything.
    z = np.ones(3 if me == 0 else 4, np.float32)
    if me == 1:
        wz = mismatch_group.all_reduce(z, async_op=True)
        world.kv.set("mismatch/issued", b"1")
    else:
        world.kv.get("mismatch/issued", wait=True, timeout=KV_TIMEOUT)
        wz = mismatch_group.all_reduce(z, async_op=True)
    exc = rep.raises("mismatch: both ranks", pp.CollectiveMismatch, lambda: wz.wait(30), "(3,)", "(4,)")
    rep.raises("mismatch: sticky", pp.CollectiveMismatch, lambda: mismatch_group.barrier())
    rep.values["mismatch_text"] = str(exc)
    # Split sizes that disagree (rank 0 sends rank 1 two rows, rank 1 expects one): every rank raises before
    # any data moves, and the group stays usable.
    b = np.ones((3, 2), np.float32)
    rep.raises(
        "mismatch: all_to_all split sizes",
        pp.CollectiveMismatch,
        lambda: a2a_group.all_to_all(
            b, in_splits=[1, 2] if me == 0 else [2, 1], out_splits=[1, 1] if me == 1 else None
        ),
        "split sizes disagree",
    )
    s = np.full(2, me + 1.0)
    a2a_group.all_reduce(s)
    rep.equal("mismatch: the group still works after split sizes that disagree", s, np.full(2, 3.0))
    a = np.ones((4, 2) if me == 0 else (4, 3), np.float32)  # blocks of 2 against 3 elements
    rep.raises(
        "mismatch: all_to_all", pp.CollectiveMismatch, lambda: a2a_group.all_to_all(a), "(4, 2)", "(4, 3)"
    )
    # Split sizes that agree but rows that do not (2 against 3 elements): the exchange itself is a
    # CollectiveMismatch on both ranks naming both row shapes, not rows read at the wrong width.
    u = np.ones((3, 2) if me == 0 else (3, 3), np.float32)
    rep.raises(
        "mismatch: all_to_all with split sizes and rows that differ",
        pp.CollectiveMismatch,
        lambda: uneven_group.all_to_all(u, in_splits=[1, 2] if me == 0 else [2, 1]),
        "2)",
        "3)",
    )
    world.barrier("after-mismatch", timeout=KV_TIMEOUT)

    # Group timeout (PARAMPLANE_TIMEOUT) with rank 1 never calling: CollectiveTimeout on rank 0.
    if me == 0:
        start = time.monotonic()
        rep.raises(
            "timeout: group", pp.CollectiveTimeout, lambda: g.all_reduce(np.ones(3)), "PARAMPLANE_TIMEOUT"
        )
        rep.values["timeout_elapsed"] = time.monotonic() - start
        # A Work whose op failed re-raises the op's own error, not "still running".
        wt = g.barrier(async_op=True)
        rep.raises("work-error: failed op", pp.CollectiveTimeout, lambda: wt.wait(30), "PARAMPLANE_TIMEOUT")
    world.barrier("after-timeout", timeout=KV_TIMEOUT)

    # After shutdown every op fails with PlaneClosed.
    world.shutdown()
    rep.raises("closed: all_reduce", pp.PlaneClosed, lambda: fresh_group.all_reduce(np.ones(2)))
    rep.raises("closed: barrier", pp.PlaneClosed, lambda: fresh_group.barrier())
    w2 = fresh_group.all_gather(np.ones(2), async_op=True)
    rep.raises("closed: async op", pp.PlaneClosed, lambda: w2.wait(10))
    rep.raises("closed: kv", pp.PlaneClosed, lambda: world.kv.set("k", b"v"))


def peer_lost(world: pp.World, rep: Report) -> None:
    me = world.rank
    g = world.group
    x = np.ones(2 << 20, np.float32)  # 8 MiB: the ring (gRPC) / several rounds (shm)
    g.all_reduce(x)  # warm up every stream and the segment
    rep.equal("warm-up", x, np.full(2 << 20, float(world.world_size), np.float32))
    if me == world.world_size - 1:
        die_mid_op(rep)
    try:
        g.all_reduce(x)
        rep.check("all_reduce with a dead rank fails", False, "it returned")
    except pp.PeerLost as exc:
        rep.values.update(error_at=time.time(), error_rank=exc.rank, error_text=str(exc))
    except BaseException as exc:
        rep.values.update(error_at=time.time(), error_type=type(exc).__name__, error_text=str(exc))
        rep.check("all_reduce with a dead rank raises PeerLost", False, f"{type(exc).__name__}: {exc}")
    rep.values["error_type"] = rep.values.get("error_type", "PeerLost")
    # The group stays failed: the next op raises at once.
    rep.raises("later op fails too", pp.PlaneError, lambda: g.barrier())


def sender_dies(world: pp.World, rep: Report) -> None:
    """The last rank dies right after a warm-up; the others then only *receive* from it (broadcast)."""
    me, last = world.rank, world.world_size - 1
    g = world.group
    x = np.full(2 << 20, float(me), np.float32)
    g.broadcast(x, src=last)  # opens the stream from the last rank to every other
    rep.equal("warm-up", x, np.full(2 << 20, float(last), np.float32))
    # Through the coordinator: every rank consumed the warm-up before the sender dies (a sender
    # that crashes right after a send may take frames still queued in its process with it).
    world.barrier("warm-up done", timeout=KV_TIMEOUT)
    if me == last:
        rep.values["died_at"] = time.time()
        rep.write()
        os._exit(17)
    try:
        g.broadcast(x, src=last)
        rep.check("broadcast from a dead rank fails", False, "it returned")
    except pp.PlaneError as exc:
        rep.values.update(error_at=time.time(), error_type=type(exc).__name__, error_text=str(exc))
        rep.values["error_rank"] = getattr(exc, "rank", None)


def die_mid_op(rep: Report) -> None:
    """Make this rank os._exit part way through its next all_reduce (after sending some of it)."""
    from paramplane.node.algorithms import ring
    from paramplane.node.transports import shm

    def exit_now() -> None:
        rep.values["died_at"] = time.time()
        rep.write()
        os._exit(17)

    def ring_all_gather(*_args: Any, **_kwargs: Any) -> None:
        exit_now()

    calls = [0]
    original_sync = shm.ShmComm._sync

    def sync(self: Any, deadline: float) -> None:
        calls[0] += 1
        if calls[0] == 3:
            exit_now()
        original_sync(self, deadline)

    ring.ring_all_gather = ring_all_gather
    shm.ShmComm._sync = sync  # type: ignore[method-assign]


def malformed(world: pp.World, rep: Report) -> None:
    me = world.rank
    g = world.group
    if me == 0:
        w = g.all_reduce(np.ones(4), async_op=True)
        world.kv.set("pending", b"1")
        start = time.monotonic()
        rep.raises(
            "pending op fails on a malformed frame", pp.TransportError, lambda: w.wait(30), "malformed"
        )
        rep.values["fail_elapsed"] = time.monotonic() - start
        world.kv.set("done", b"1")
        return
    world.kv.get("pending", wait=True, timeout=KV_TIMEOUT)
    peer = world.runtime.membership.peers[0]
    token = os.environ["PARAMPLANE_TOKEN"]
    with grpc.insecure_channel(peer.address) as channel:
        hello = channel.unary_unary(
            "/paramplane.v1.Peer/Hello",
            request_serializer=peer_pb2.HelloRequest.SerializeToString,
            response_deserializer=peer_pb2.HelloResponse.FromString,
        )
        rep.check(
            "hello with the token",
            hello(peer_pb2.HelloRequest(rank=1), metadata=token_metadata(token), timeout=10).rank == 0,
        )
        for name, metadata in (("no token", None), ("wrong token", token_metadata(token + "x"))):
            try:
                hello(peer_pb2.HelloRequest(rank=1), metadata=metadata, timeout=10)
                rep.check(f"hello with {name}", False, "accepted")
            except grpc.RpcError as err:
                rep.check(
                    f"hello with {name}", err.code() == grpc.StatusCode.UNAUTHENTICATED, str(err.code())
                )
                rep.check(f"{name}: token not echoed", token not in (err.details() or ""), "token in details")
        push = channel.stream_unary("/paramplane.v1.Peer/Push")
        opening = peer_pb2.StreamOpen(src=1, job_id=world.job_id, group="world").SerializeToString()
        garbage = b"\x0a\xff\xff\xff\xff\x0f"  # a length-delimited field far longer than the message
        try:
            push(iter([opening, garbage]), metadata=token_metadata(token), timeout=10)
            rep.check("malformed frame refused", False, "accepted")
        except grpc.RpcError as err:
            rep.check(
                "malformed frame refused", err.code() == grpc.StatusCode.INVALID_ARGUMENT, str(err.code())
            )
    world.kv.get("done", wait=True, timeout=KV_TIMEOUT)


def oversized(world: pp.World, rep: Report) -> None:
    """Rank 1 pushes one message over the data plane's size limit straight at rank 0's server."""
    g = world.group
    if world.rank == 0:
        w = g.all_reduce(np.ones(4), async_op=True)
        world.kv.set("pending", b"1")
        rep.raises(
            "pending op fails on an oversized message", pp.TransportError, lambda: w.wait(30), "too large"
        )
        world.kv.set("done", b"1")
        return
    world.kv.get("pending", wait=True, timeout=KV_TIMEOUT)
    peer = world.runtime.membership.peers[0]
    with grpc.insecure_channel(peer.address, options=[("grpc.max_send_message_length", 8 << 20)]) as channel:
        push = channel.stream_unary("/paramplane.v1.Peer/Push")
        opening = peer_pb2.StreamOpen(src=1, job_id=world.job_id, group="world").SerializeToString()
        try:
            push(
                iter([opening, b"x" * (3 << 20)]),
                metadata=token_metadata(os.environ["PARAMPLANE_TOKEN"]),
                timeout=10,
            )
            rep.check("oversized message refused", False, "accepted")
        except grpc.RpcError as err:
            rep.check(
                "oversized message refused", err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, str(err.code())
            )
    world.kv.get("done", wait=True, timeout=KV_TIMEOUT)


def main() -> None:
    scenario = {
        "errors": errors,
        "peer-lost": peer_lost,
        "sender-dies": sender_dies,
        "malformed": malformed,
        "oversized": oversized,
    }[sys.argv[1]]
    run_rank(scenario)


if __name__ == "__main__":
    main()
