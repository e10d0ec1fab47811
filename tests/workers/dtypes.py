"""Every dtype the README lists, through every collective on this world's transport.

float16, bfloat16, float32, float64, int8, int32, int64, uint8 and bool: all_reduce (sum, max),
broadcast, all_gather and reduce_scatter, at a small size and at one just over a 1 MiB chunk
(so gRPC takes its ring path and shm several rounds). Integers and bool must be exact; floats
within their precision of a float64 reference. Then a float16 mean whose sum overflows float16.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
from _common import Report, run_rank

from paramplane.node.arrays import DTYPES  # every dtype the plane moves (the README lists the same)

RTOL = {"float16": 1e-2, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}


def make(rank: int, tag: str, dtype: np.dtype[Any], size: int) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(f"{tag}|{rank}".encode()))
    if dtype == np.bool_:
        return rng.integers(0, 2, size).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0 if dtype.kind == "u" else -3, 4, size).astype(dtype)
    return rng.uniform(0.5, 2.0, size).astype(np.float32).astype(dtype)


def check(rep: Report, tag: str, got: Any, want: np.ndarray, name: str) -> None:
    if name in RTOL:
        rep.equal(tag, got, want, rtol=RTOL[name])
    else:
        rep.check(tag, got.dtype == want.dtype and np.array_equal(got, want), f"{got[:4]} vs {want[:4]}")


def scenario(world: Any, rep: Report) -> None:
    g, n, me = world.group, world.world_size, world.rank
    for name, dtype in DTYPES.items():
        for size in (5, (1 << 20) // dtype.itemsize + 3):
            tag = f"{name}/{size}"
            ins = [make(r, tag, dtype, size) for r in range(n)]
            wide = [x.astype(np.float64) if name in RTOL else x for x in ins]
            x = ins[me].copy()
            g.all_reduce(x, "sum")
            total = np.logical_or.reduce(ins) if name == "bool" else np.sum(wide, axis=0)
            check(rep, f"{tag} all_reduce sum", x, total.astype(dtype) if name not in RTOL else total, name)
            y = ins[me].copy()
            g.all_reduce(y, "max")
            check(rep, f"{tag} all_reduce max", y, np.max(ins, axis=0), name)
            z = ins[me].copy()
            g.broadcast(z, src=n - 1)
            check(rep, f"{tag} broadcast", z, ins[n - 1], name)
            check(rep, f"{tag} all_gather", g.all_gather(ins[me]), np.concatenate(ins), name)
            rows = np.array_split(np.arange(size), n)[me]
            part = g.reduce_scatter(ins[me], "sum")
            want = total[rows[0] : rows[-1] + 1] if len(rows) else total[:0]
            check(rep, f"{tag} reduce_scatter", part, want.astype(dtype) if name not in RTOL else want, name)
    # A float16 mean whose sum would overflow (65504) but whose mean does not: it divides before summing.
    big = np.full(7, 40000 + 1000 * me, np.float16)
    want = np.full(7, 40000 + 1000 * (n - 1) / 2)
    x = big.copy()
    g.all_reduce(x, "mean")
    rep.equal("float16 all_reduce mean past the sum's range", x, want, rtol=1e-3)
    part = g.reduce_scatter(big, "mean")
    rep.equal("float16 reduce_scatter mean past the sum's range", part, want[: len(part)], rtol=1e-3)
    rep.equal("reduce_scatter leaves its input", big, np.full(7, 40000 + 1000 * me, np.float16))


if __name__ == "__main__":
    run_rank(scenario)
