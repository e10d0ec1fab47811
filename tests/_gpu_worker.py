"""One rank of the GPU test: NCCL collectives on cupy arrays, checked against numpy."""

from __future__ import annotations

import json
import sys

import numpy as np

import paramplane as pp


def main(out: str) -> None:
    import cupy

    with pp.init() as world:
        world.use_gpu()
        g = world.group
        n = world.world_size
        x = cupy.arange(1001, dtype=cupy.float32) * (world.rank + 1)
        g.all_reduce(x)
        expect = np.arange(1001, dtype=np.float32) * sum(range(1, n + 1))
        b = cupy.full(7, world.rank, cupy.int64)
        g.broadcast(b, src=n - 1)
        gathered = g.all_gather(cupy.full((2,), world.rank, cupy.float64))
        rs = g.reduce_scatter(cupy.ones((n * 3 + 1, 2), cupy.float32))
        cupy.cuda.get_current_stream().synchronize()
        result = {
            "all_reduce": bool(np.allclose(x.get(), expect)),
            "broadcast": bool((b.get() == n - 1).all()),
            "all_gather": gathered.get().tolist() == [float(r) for r in range(n) for _ in range(2)],
            "reduce_scatter": bool((rs.get() == n).all()),
            "transport": g._e.transport_for(x, "all_reduce"),
        }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
