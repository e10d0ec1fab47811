"""One rank of the GPU test: every collective on cupy arrays (NCCL where it moves the dtype, staged
through host memory for bool), every reduction, async ops on the caller's stream; checked against numpy."""

from __future__ import annotations

import json
import sys

import numpy as np

import paramplane as pp

DTYPES = ("float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool")
OPS = {"sum": np.sum, "product": np.prod, "min": np.min, "max": np.max}


def main(out: str) -> None:
    import cupy

    result: dict[str, bool] = {}
    with pp.init() as world:
        world.use_gpu()
        g = world.group
        n, r = world.world_size, world.rank
        contributions = [np.arange(1, 8) % 3 + k for k in range(n)]  # small values: no overflow in int8
        for dtype in DTYPES:
            for op, fold in OPS.items():
                mine = contributions[r].astype(dtype)
                x = cupy.asarray(mine)
                g.all_reduce(x, op)
                want = fold(np.stack([c.astype(dtype) for c in contributions]), axis=0).astype(dtype)
                result[f"all_reduce {op} {dtype}"] = bool((x.get() == want).all())
        m = cupy.full(5, float(r + 1), cupy.float32)
        g.all_reduce(m, "mean")
        result["all_reduce mean"] = bool(np.allclose(m.get(), sum(range(1, n + 1)) / n))
        result["nccl moves float32"] = g._e.transport_for(m, "all_reduce") == "nccl"
        result["bool is staged"] = g._e.transport_for(cupy.zeros(1, bool), "all_reduce") != "nccl"

        b = cupy.full(7, r, cupy.int64)
        g.broadcast(b, src=n - 1)
        result["broadcast"] = bool((b.get() == n - 1).all())
        gathered = g.all_gather(cupy.full((2,), r, cupy.float64))
        result["all_gather"] = gathered.get().tolist() == [float(k) for k in range(n) for _ in range(2)]
        rs = g.reduce_scatter(cupy.ones((n * 3 + 1, 2), cupy.float32))
        result["reduce_scatter"] = bool((rs.get() == n).all())
        pieces = g.gather(cupy.full(3, r, cupy.int32), dst=0)
        if r == 0:
            result["gather"] = pieces.get().tolist() == [k for k in range(n) for _ in range(3)]
        if r == 0:
            mine_chunk = g.scatter([cupy.full(2, k * 10, cupy.float32) for k in range(n)], src=0)
        else:
            mine_chunk = g.scatter(cupy.zeros(2, cupy.float32), src=0)
        result["scatter"] = mine_chunk.get().tolist() == [r * 10.0] * 2
        if r == 0:
            g.send(cupy.arange(4, dtype=cupy.float32), dst=1)
        elif r == 1:
            got = cupy.zeros(4, cupy.float32)
            g.recv(got, src=0)
            result["send/recv"] = got.get().tolist() == [0.0, 1.0, 2.0, 3.0]
        g.barrier()

        # Async on a side stream: the op is ordered after the kernel that filled the array on that
        # stream, and Work.wait() returns once the result is usable on it.
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            big = cupy.full(1 << 20, 1.0, cupy.float32)
            big *= r + 1
            work = g.all_reduce(big, "sum", async_op=True)
            work.wait()
            total = float(big.sum().get())
        result["async on caller's stream"] = total == float((1 << 20) * sum(range(1, n + 1)))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
