"""Rank worker: all_reduce across two fake hosts (PARAMPLANE_HOST_ID) with transport auto.

``hierarchy.py mismatch`` (ranks 0-1 on one host, 2-3 on the other): the hosts all-reduce shapes of 5 and
6 elements, which split into equal pieces per local rank; every rank gets a CollectiveMismatch naming both.
"""

from __future__ import annotations

import sys

import numpy as np
from _common import DTYPES, RTOL, Report, data, digest, reference, run_rank

import paramplane as pp


def scenario(world: pp.World, rep: Report) -> None:
    rep.values["host_id"] = world.host_id
    rep.values["local_rank"] = world.local_rank
    g, n, me = world.group, world.world_size, world.rank
    cases = [
        ("float32", "sum"),
        ("float64", "mean"),
        ("int64", "sum"),
        ("int64", "max"),
        ("bfloat16", "sum"),
        ("float32", "product"),
    ]
    for dname, op in cases:
        dtype = DTYPES[dname]
        for shape in ((1,), (7,), (143, 7), ((1 << 20) // dtype.itemsize + 1,)):
            tag = f"hier/{dname}/{op}/{shape}"
            inputs = [data(r, tag, dtype, shape, op) for r in range(n)]
            want = reference(inputs, op)
            x = inputs[me].copy()
            g.all_reduce(x, op)
            exact = dname == "int64" or op in ("min", "max")
            rep.equal(tag, x, want, rtol=None if exact else RTOL[dname])
            rep.digests[tag] = digest(x)
    # Other collectives across the two hosts still work (gRPC).
    y = np.full(4, me, np.int64)
    g.broadcast(y, src=3)
    rep.equal("broadcast across hosts", y, np.full(4, 3, np.int64))
    rep.equal(
        "all_gather across hosts",
        g.all_gather(np.array([me], np.int64)),
        np.arange(n, dtype=np.int64),
    )
    g.barrier()


def mismatch(world: pp.World, rep: Report) -> None:
    shape = (5,) if world.rank < 2 else (2, 3)
    rep.raises(
        "hosts disagree on the shape", pp.CollectiveMismatch, lambda: world.group.all_reduce(np.ones(shape))
    )
    world.barrier()  # no rank leaves before every rank was told (a departure would read as PeerLost)


def main() -> None:
    run_rank(mismatch if sys.argv[1:] == ["mismatch"] else scenario)


if __name__ == "__main__":
    main()
