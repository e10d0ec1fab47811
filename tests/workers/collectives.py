"""Rank worker: every collective x reduction x dtype x size against numpy references.

Run by tests/transport/test_collectives.py through tests/_world.py; the transport comes from
PARAMPLANE_TRANSPORT. ``--full-big`` runs every op and dtype at the 1 MiB + 1 size (else
only all_reduce sum and reduce_scatter there); ``--extras`` adds the subgroup, two
groups in flight, point-to-point ring and asyncio checks.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import numpy as np
from _common import DTYPES, RTOL, Report, data, digest, is_int, reference, run_rank

import paramplane as pp

REDUCE_OPS = ("sum", "mean", "min", "max", "product")


def shapes(dtype: np.dtype[Any]) -> list[tuple[str, tuple[int, ...]]]:
    big = (1 << 20) // dtype.itemsize + 1
    return [("one", (1,)), ("odd", (143, 7)), ("big", (big,))]


def tol(dtype_name: str, op: str) -> float | None:
    return None if op in ("min", "max") or dtype_name == "int64" else RTOL[dtype_name]


def reductions(world: pp.World, rep: Report, full_big: bool) -> None:
    g, n, me = world.group, world.world_size, world.rank
    for dname, dtype in DTYPES.items():
        for sname, shape in shapes(dtype):
            for op in REDUCE_OPS:
                tag = f"{dname}/{sname}/{op}"
                if op == "mean" and is_int(dtype):
                    x = data(me, tag, dtype, shape)
                    rep.raises(
                        f"all_reduce {tag} ValueError",
                        ValueError,
                        lambda x=x: g.all_reduce(x, "mean"),
                        "mean",
                    )
                    rep.raises(
                        f"reduce_scatter {tag} ValueError",
                        ValueError,
                        lambda x=x: g.reduce_scatter(x, "mean"),
                    )
                    continue
                inputs = [data(r, tag, dtype, shape, op) for r in range(n)]
                want = reference(inputs, op)
                if sname != "big" or full_big or op == "sum":
                    x = inputs[me].copy()
                    got = g.all_reduce(x, op)
                    rep.check(f"all_reduce {tag} returns x", got is x)
                    rep.equal(
                        f"all_reduce {tag}",
                        x,
                        want.astype(dtype) if tol(dname, op) is None else want,
                        rtol=tol(dname, op),
                    )
                    rep.check(f"all_reduce {tag} dtype", x.dtype == dtype, str(x.dtype))
                    rep.digests[f"all_reduce {tag}"] = digest(x)
                if sname != "big" or full_big or op in ("sum", "max"):
                    x = inputs[me].copy()
                    piece = g.reduce_scatter(x, op)
                    mine = np.array_split(want, n, axis=0)[me]
                    rep.equal(
                        f"reduce_scatter {tag}",
                        piece,
                        mine.astype(dtype) if tol(dname, op) is None else mine,
                        rtol=tol(dname, op),
                    )
                    rep.check(f"reduce_scatter {tag} keeps x", np.array_equal(x, inputs[me]))
                    if op == "sum":
                        buf = np.empty_like(piece)
                        got = g.reduce_scatter(x, op, out=buf)
                        rep.check(
                            f"reduce_scatter {tag} out= is filled", got is buf and np.array_equal(buf, piece)
                        )


def movement(world: pp.World, rep: Report, full_big: bool) -> None:
    g, n, me = world.group, world.world_size, world.rank
    for dname, dtype in DTYPES.items():
        for sname, shape in shapes(dtype):
            if sname == "big" and not full_big and dname != "float32":
                continue
            tag = f"{dname}/{sname}"
            inputs = [data(r, tag, dtype, shape) for r in range(n)]
            root = len(tag) % n

            x = inputs[me].copy()
            g.broadcast(x, src=root)
            rep.equal(f"broadcast {tag} src={root}", x, inputs[root])

            rep.equal(f"all_gather {tag}", g.all_gather(inputs[me]), np.concatenate(inputs))
            buf = np.empty((n * shape[0], *shape[1:]), dtype)
            rep.check(f"all_gather {tag} out= is filled", g.all_gather(inputs[me], out=buf) is buf)
            rep.equal(f"all_gather {tag} out=", buf, np.concatenate(inputs))
            rep.raises(
                f"all_gather {tag} bad out",
                ValueError,
                lambda x=inputs[me], bad=buf[:1]: g.all_gather(x, out=bad),
                "out must be",
            )

            got = g.gather(inputs[me], dst=root)
            if me == root:
                rep.equal(f"gather {tag} dst={root}", got, np.concatenate(inputs))
            else:
                rep.check(f"gather {tag} non-root gets None", got is None, repr(type(got)))

            blocks = [data(r, f"{tag}/a2a", dtype, (n * shape[0], *shape[1:])) for r in range(n)]
            rows = shape[0]
            want = np.concatenate([b[me * rows : (me + 1) * rows] for b in blocks])
            rep.equal(f"all_to_all {tag}", g.all_to_all(blocks[me]), want)
            buf = np.empty_like(blocks[me])
            rep.check(f"all_to_all {tag} out= is filled", g.all_to_all(blocks[me], out=buf) is buf)
            rep.equal(f"all_to_all {tag} out=", buf, want)
            rep.raises(
                f"all_to_all {tag} out= the input",
                ValueError,
                lambda x=blocks[me]: g.all_to_all(x, out=x),
                "must not overlap",
            )

            chunks = [data(root, f"{tag}/chunk{i}", dtype, shape) for i in range(n)]
            if me == root:
                got = g.scatter(chunks, src=root)
            else:
                buf = np.zeros(shape, dtype)
                got = g.scatter(buf, src=root)
                rep.check(f"scatter {tag} fills the buffer", got is buf)
            rep.equal(f"scatter {tag} src={root}", got, chunks[me])
    g.barrier()
    # Async forms: Work handles complete in issue order with the same results.
    x = data(me, "work", DTYPES["float64"], (1001,))
    want = reference([data(r, "work", DTYPES["float64"], (1001,)) for r in range(n)], "sum")
    w1 = g.all_reduce(x, async_op=True)
    w2 = g.all_gather(np.array([me], np.int64), async_op=True)
    rep.check("work wait returns x", w1.wait(30) is x)
    rep.equal("work all_reduce", x, want, rtol=1e-12)
    rep.equal("work all_gather", w2.wait(30), np.arange(n, dtype=np.int64))
    rep.check("work completed", w1.is_completed() and w2.is_completed() and w1.exception() is None)

    async def coro() -> Any:
        y = np.full(3, me + 1, np.int64)
        await g.all_reduce_async(y, "max")
        await g.barrier_async()
        return y

    rep.equal("all_reduce_async", asyncio.run(coro()), np.full(3, n, np.int64))


def extras(world: pp.World, rep: Report) -> None:
    n, me = world.world_size, world.rank
    g = world.group
    # Point-to-point ring: send right, receive from the left, with sends in flight.
    for sname, shape in (("odd", (1001,)), ("big", ((1 << 20) // 4 + 1,))):
        tag = f"ring/{sname}"
        x = data(me, tag, DTYPES["float32"], shape)
        buf = np.zeros(shape, np.float32)
        w = g.send(x, (me + 1) % n, async_op=True)
        g.recv(buf, (me - 1) % n)
        w.wait(30)
        rep.equal(f"send/recv {tag}", buf, data((me - 1) % n, tag, DTYPES["float32"], shape))

    # all_to_all with split sizes: rank r sends (r + j) % 3 rows to rank j (some none), rows of 5 float32
    def rows_to(src: int, dst: int) -> np.ndarray:
        count = (src + dst) % 3
        return (np.arange(count * 5, dtype=np.float32).reshape(count, 5) + 1000 * src + 100 * dst).astype(
            np.float32
        )

    x = np.concatenate([rows_to(me, j) for j in range(n)])
    want = np.concatenate([rows_to(j, me) for j in range(n)])
    sends = [(me + j) % 3 for j in range(n)]
    rep.equal("all_to_all with in_splits", g.all_to_all(x, in_splits=sends), want)
    buf = np.empty_like(want)
    w = g.all_to_all(x, out=buf, in_splits=sends, out_splits=[(j + me) % 3 for j in range(n)], async_op=True)
    rep.check(
        "all_to_all with in_splits and out_splits into out=", w.wait(30) is buf and np.array_equal(buf, want)
    )

    # Pieces of different lengths, some empty, the longest over several shm rounds of the small slot: each ends
    # in its own round (rows of 4096 float32, up to 16 rows, not padded to the longest).
    def big_rows(src: int, dst: int) -> np.ndarray:
        count = ((src * 7 + dst * 3) % 5) * 4
        return np.arange(count * 4096, dtype=np.float32).reshape(count, 4096) + 100_000 * src + 10_000 * dst

    sends = [((me * 7 + j * 3) % 5) * 4 for j in range(n)]
    got = g.all_to_all(np.concatenate([big_rows(me, j) for j in range(n)]), in_splits=sends)
    rep.equal(
        "all_to_all with uneven pieces over rounds", got, np.concatenate([big_rows(j, me) for j in range(n)])
    )
    # A strided out (every other column of a wider array) and a Fortran-ordered x: the rows land in out itself.
    wide = np.zeros((want.shape[0], 10), np.float32)
    got = g.all_to_all(np.asfortranarray(x), out=wide[:, ::2], in_splits=[(me + j) % 3 for j in range(n)])
    rep.check(
        "all_to_all with split sizes into a strided out", np.array_equal(wide[:, ::2], want), str(got.shape)
    )
    rep.raises(
        "all_to_all with split sizes into an out that overlaps x",
        ValueError,
        lambda: g.all_to_all(x, out=x, in_splits=[(j + me) % 3 for j in range(n)]),
        "overlap",
    )
    empty = g.all_to_all(np.zeros((0, 5), np.float32), in_splits=[0] * n)
    rep.check("all_to_all of no rows", empty.shape == (0, 5), str(empty.shape))
    rep.raises(
        "all_to_all in_splits that do not sum to the rows",
        ValueError,
        lambda: g.all_to_all(x, in_splits=[s + 1 for s in sends]),
        "sum to",
    )

    if n < 4:
        return
    # Subgroup of 2 inside the world; non-members get None.
    sub = world.new_group([1, 2])
    if me in (1, 2):
        assert sub is not None
        rep.check(
            "subgroup rank/size",
            (sub.rank, sub.size, sub.ranks) == ([1, 2].index(me), 2, [1, 2]),
            f"{sub.rank} {sub.size} {sub.ranks}",
        )
        for sname, shape in (("odd", (143, 7)), ("big", ((1 << 20) // 8 + 1,))):
            tag = f"sub/{sname}"
            x = data(me, tag, DTYPES["float64"], shape)
            sub.all_reduce(x)
            want = reference([data(r, tag, DTYPES["float64"], shape) for r in (1, 2)], "sum")
            rep.equal(f"subgroup all_reduce {tag}", x, want, rtol=1e-12)
            b = np.full(5, me, np.int64)
            sub.broadcast(b, src=1)
            rep.equal(f"subgroup broadcast {tag}", b, np.full(5, 2, np.int64))
    else:
        rep.check("non-member gets None", sub is None, repr(sub))
    # Two groups with a big op in flight on each, issued in opposite orders by even and odd ranks.
    other = world.new_group(list(range(n)))
    assert other is not None
    shape = ((1 << 20) // 4 + 1,)
    a = data(me, "twoA", DTYPES["float32"], shape)
    b = data(me, "twoB", DTYPES["float32"], shape)
    if me % 2 == 0:
        wa = g.all_reduce(a, async_op=True)
        wb = other.all_reduce(b, "max", async_op=True)
    else:
        wb = other.all_reduce(b, "max", async_op=True)
        wa = g.all_reduce(a, async_op=True)
    wb.wait(60)
    wa.wait(60)
    rep.equal(
        "two groups: world sum",
        a,
        reference([data(r, "twoA", DTYPES["float32"], shape) for r in range(n)], "sum"),
        rtol=1e-5,
    )
    rep.equal(
        "two groups: other max",
        b,
        reference([data(r, "twoB", DTYPES["float32"], shape) for r in range(n)], "max"),
    )
    world.group.barrier()


def scenario(world: pp.World, rep: Report) -> None:
    full_big = "--full-big" in sys.argv
    reductions(world, rep, full_big)
    movement(world, rep, full_big)
    if "--extras" in sys.argv:
        extras(world, rep)
    world.group.barrier()
    # Which links carried the frames (Unix or TCP lanes, gRPC streams), and whether shared memory was set up.
    rep.values["streams"] = sorted(world.runtime.plane.outbound_kinds())
    rep.values["shm_used"] = world.group._e.transports._shm is not None


def main() -> None:
    run_rank(scenario)


if __name__ == "__main__":
    main()
