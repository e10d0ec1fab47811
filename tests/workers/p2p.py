"""Rank worker for tests/transport/test_p2p.py (2 ranks): point-to-point order, shapes from headers, and errors.

- ``order``: small messages (sent at once from the caller's thread) and large ones (written by the
  event loop) interleaved and all in flight, received in order; ``recv_array`` keeps each dtype and
  shape; a two-way exchange of 8 MiB each way with both sends in flight does not deadlock.
  A blocking receive with none queued before it takes its frame on the caller's thread (counted, so the
  checks know that path ran); one behind an asynchronous receive still pairs up in issue order.
- ``errors`` (PARAMPLANE_TIMEOUT=2): a receive nobody sends to times out; a receive of the wrong shape is
  a CollectiveMismatch on the receiver, and the sender's next message on that group fails with it too;
  both on a fresh group and on one that already carried a message (the caller's-thread path).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
from _common import Report, run_rank

import paramplane as pp

KV_TIMEOUT = 30.0
# (dtype, shape): tiny, 0-d, inline-sized and several chunk-sized messages, in an order that mixes them.
MESSAGES: list[tuple[str, tuple[int, ...]]] = [
    ("float32", (3,)),
    ("float64", (300_000,)),  # 2.4 MB: the loop writes it (chunked)
    ("int32", (2, 3, 4)),
    ("float64", ()),
    ("int64", (9_000,)),  # 72 KB: just over the inline limit
    ("float32", (1, 8)),
    ("uint8", (3 << 20,)),
    ("float64", (5, 5)),
]


def message(i: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    size = int(np.prod(shape, dtype=np.int64))
    return ((np.arange(size) * 7 + i) % 120).astype(dtype).reshape(shape)


def count_direct_receives() -> dict[str, int]:
    """Counts blocking receives that took their frame on the caller's thread: by the full checks
    (``GrpcPointToPoint.recv_now``: ``direct``) or by the short path of a dtype and shape the line carried
    before (``recv_small``: ``short``), and those that raised there."""
    from paramplane.node.transports.p2p import GrpcPointToPoint

    counts = {"direct": 0, "direct_raised": 0, "short": 0, "short_raised": 0, "not_short": 0, "loop": 0}

    def counting(method: Any, path: str, none: str) -> Any:
        """``method`` counting its calls under ``path`` (None returned: under ``none``), and raises."""

        def counted(self: GrpcPointToPoint, *args: Any) -> Any:
            try:
                got = method(self, *args)
            except Exception:
                counts[f"{path}_raised"] += 1
                raise
            counts[none if got is None else path] += 1
            return got

        return counted

    GrpcPointToPoint.recv_now = counting(GrpcPointToPoint.recv_now, "direct", "loop")  # type: ignore[method-assign]
    GrpcPointToPoint.recv_small = counting(GrpcPointToPoint.recv_small, "short", "not_short")  # type: ignore[method-assign]
    return counts


def order(world: pp.World, rep: Report) -> None:
    g, me = world.group, world.rank
    peer = 1 - me
    receives = count_direct_receives()
    for rnd in range(3):  # later rounds find the lane open: the direct path
        if me == 0:
            works = [g.send(message(i + rnd, d, s), peer, async_op=True) for i, (d, s) in enumerate(MESSAGES)]
            for w in works:
                w.wait(30)
        else:
            posted = [g.recv_array(peer, async_op=True) for _ in MESSAGES]
            for i, ((d, s), w) in enumerate(zip(MESSAGES, posted)):
                got = w.wait(30)
                rep.equal(f"order: round {rnd} message {i} ({d}, {s})", got, message(i + rnd, d, s))
        # The same messages into buffers the receiver allocated, received one by one as they come.
        if me == 0:
            for i, (d, s) in enumerate(MESSAGES):
                g.send(message(i, d, s), peer)
        else:
            for i, (d, s) in enumerate(MESSAGES):
                buf = np.empty(s, d)
                rep.check(
                    f"order: recv returns its buffer, round {rnd} message {i}", g.recv(buf, peer) is buf
                )
                rep.equal(f"order: recv into a buffer, round {rnd} message {i}", buf, message(i, d, s))
    if me == 1:
        rep.check(
            "order: blocking receives taken on the caller's thread", receives["direct"] >= 8, str(receives)
        )
        # Rounds 2 and 3 receive the small messages (4 of the 8) into dtypes and shapes round 1 carried.
        rep.check("order: later small receives take the short path", receives["short"] >= 8, str(receives))

    # A blocking receive behind an asynchronous one waits its turn: the first message is the async one's.
    if me == 0:
        world.kv.get("p2p/posted", wait=True, timeout=KV_TIMEOUT)
        g.send(np.full(4, 1.0), peer)
        g.send(np.full(4, 2.0), peer)
    else:
        first = g.recv_array(peer, async_op=True)
        world.kv.set("p2p/posted", b"1")
        second = g.recv(np.empty(4), peer)
        rep.equal("order: async then blocking receive, first", first.wait(30), np.full(4, 1.0))
        rep.equal("order: async then blocking receive, second", second, np.full(4, 2.0))

    # Small messages while the receiver reads nothing: the socket fills, so sends that would leave from the
    # caller's thread find it full (or take only part of a frame) and the loop finishes them, in order.
    from paramplane.node.lane import LaneStream

    counts = {"direct": 0, "handed_to_loop": 0}
    send_now = LaneStream.send_now

    def counting(self: LaneStream, frame: bytes) -> bytes:
        rest = send_now(self, frame)
        counts["handed_to_loop" if rest else "direct"] += 1
        return rest

    LaneStream.send_now = counting  # type: ignore[method-assign]
    num_full, size = 400, 60_000  # 24 MB: more than the socket buffers and the inbox hold
    if me == 0:
        works = [g.send(np.full(size, i % 251, np.uint8), peer, async_op=True) for i in range(num_full)]
        world.kv.set("p2p/filled", b"1")
        for w in works:
            w.wait(60)
        rep.values["send_now"] = counts
        rep.check("full socket: some sends found it full", counts["handed_to_loop"] > 0, str(counts))
        rep.check("full socket: some sends left at once", counts["direct"] > 0, str(counts))
    else:
        world.kv.get("p2p/filled", wait=True, timeout=KV_TIMEOUT)
        bad = [
            i
            for i in range(num_full)
            if not np.array_equal(g.recv(np.empty(size, np.uint8), peer), np.full(size, i % 251, np.uint8))
        ]
        rep.check("full socket: every message whole and in order", not bad, f"messages {bad[:5]} differ")
    LaneStream.send_now = send_now  # type: ignore[method-assign]

    # Both ranks send 8 MiB with the send in flight, then receive: the sends must not wait for the receives.
    mine = np.full(1 << 20, float(me))
    work = g.send(mine, peer, async_op=True)
    theirs = g.recv(np.empty(1 << 20), peer)
    work.wait(30)
    rep.equal("exchange: 8 MiB each way", theirs, np.full(1 << 20, float(peer)))


MISMATCH_TIMEOUT = 30.0
"""The mismatch groups' own timeout: their error frames must arrive far sooner (the test allows a third)."""


def errors(world: pp.World, rep: Report) -> None:
    me = world.rank
    silent = world.new_group([0, 1])
    mismatch = world.new_group([0, 1], timeout=MISMATCH_TIMEOUT)  # its error must come well before this
    assert silent is not None and mismatch is not None

    # Rank 1 never sends: rank 0's receive gives CollectiveTimeout after PARAMPLANE_TIMEOUT (2 s).
    if me == 0:
        start = time.monotonic()
        rep.raises(
            "timeout: recv with no sender", pp.CollectiveTimeout, lambda: silent.recv(np.empty(3), 1), "2 s"
        )
        rep.values["timeout_elapsed"] = time.monotonic() - start
        rep.raises(
            "timeout: the group stays failed", pp.CollectiveTimeout, lambda: silent.send(np.ones(2), 1)
        )
    world.barrier("after-timeout", timeout=KV_TIMEOUT)

    # Rank 0 sends 3 floats where rank 1 receives 4: rank 1 names both shapes; rank 0's next receive on the
    # group fails with the same mismatch (error frames), long before its timeout.
    if me == 0:
        mismatch.send(np.ones(3, np.float32), 1)
        start = time.monotonic()
        rep.raises("mismatch: sender learns it", pp.CollectiveMismatch, lambda: mismatch.recv(np.empty(1), 1))
        rep.values["mismatch_elapsed"] = time.monotonic() - start
    else:
        rep.raises(
            "mismatch: receiver",
            pp.CollectiveMismatch,
            lambda: mismatch.recv(np.empty(4, np.float32), 0),
            "(3,)",
            "(4,)",
        )
    # The same two failures on groups that already carried a message, so the blocking receive waits on the
    # caller's thread for its frame.
    silent2 = world.new_group([0, 1])
    mismatch2 = world.new_group([0, 1], timeout=MISMATCH_TIMEOUT)
    assert silent2 is not None and mismatch2 is not None
    receives = count_direct_receives()
    # One message each way the failing receives will wait: rank 0's receive on mismatch2 then waits on the
    # socket too, and is woken by the failure rank 1's error frame brings. Rank 1's receive of 4 float32 and
    # rank 0's of 2 float64 on silent2 are of a dtype and shape their line carried: the short path, whose
    # header check must name the mismatch and whose wait must time out like the full path's.
    for warm, src, like in (
        (silent2, 1, np.ones(2)),
        (mismatch2, 0, np.ones(4, np.float32)),
        (mismatch2, 1, np.ones(2)),
    ):
        if me == src:
            warm.send(like, 1 - src)
        else:
            warm.recv(np.empty_like(like), src)
    if me == 0:
        mismatch2.send(np.ones(3, np.float32), 1)
        start = time.monotonic()
        rep.raises(
            "direct mismatch: sender learns it", pp.CollectiveMismatch, lambda: mismatch2.recv(np.empty(1), 1)
        )
        rep.values["direct_mismatch_elapsed"] = time.monotonic() - start
    else:
        rep.raises(
            "direct mismatch: receiver",
            pp.CollectiveMismatch,
            lambda: mismatch2.recv(np.empty(4, np.float32), 0),
            "(3,)",
            "(4,)",
        )
    if me == 0:
        start = time.monotonic()
        rep.raises("direct timeout", pp.CollectiveTimeout, lambda: silent2.recv(np.empty(2), 1), "2 s")
        rep.values["direct_timeout_elapsed"] = time.monotonic() - start
    world.barrier("after-direct-timeout", timeout=KV_TIMEOUT)
    rep.check(
        "direct: the failing receive waited on the caller's thread",
        receives["direct_raised"] + receives["short_raised"] >= 1,
        str(receives),
    )
    rep.check(
        "direct: rank 1's mismatch and rank 0's timeout came by the short path",
        receives["short_raised"] >= 1 and (me == 1 or receives["direct_raised"] >= 1),
        str(receives),
    )
    rep.values["direct_receives"] = dict(receives)

    # Argument errors come before any communication and fail nothing.
    g = world.group
    rep.raises("input: send to itself", ValueError, lambda: g.send(np.ones(2), me), "itself")
    rep.raises("input: recv from a rank outside", ValueError, lambda: g.recv_array(5))
    rep.raises("input: non-contiguous send", ValueError, lambda: g.send(np.ones(6)[::2], 1 - me))
    x = np.full(2, float(me))
    if me == 0:
        g.send(x, 1)
    else:
        g.recv(x, 0)
    rep.equal("input: group still in step", x, np.zeros(2))


def main() -> None:
    scenarios: dict[str, Any] = {"order": order, "errors": errors}
    run_rank(scenarios[sys.argv[1]])


if __name__ == "__main__":
    main()
