"""A DDP job started by a scheduler (mpirun, srun, a Kubernetes Indexed Job): ``pp.init()`` with no arguments.

Usage: ``scheduled_ddp.py OUT_DIR``. Every rank trains an MLP for a few SGD steps on its shard of each batch and
checks the result against the same steps in one process on the whole batch (a wrong reduction, a missing rank or
a rank trained on the wrong shard fails it); then writes OUT_DIR/rank<r>.json with what it saw.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import paramplane as pp
from paramplane.nn import Linear, MSELoss, ReLU, Sequential
from paramplane.optim import SGD
from paramplane.parallel.ddp import DDP, shard_range


def build(seed: int) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(Linear(8, 16, rng=rng), ReLU(), Linear(16, 1, rng=rng))


def train(model: object, optimizer: SGD, x: np.ndarray, y: np.ndarray, rows: slice, batch: int) -> None:
    crit = MSELoss(reduction="sum")
    optimizer.zero_grad()
    crit.forward(model.forward(x[rows]), y[rows])  # type: ignore[attr-defined]
    model.backward(crit.backward(grad_scale=1.0 / batch))  # type: ignore[attr-defined]
    optimizer.step()


def main() -> None:
    out = sys.argv[1]
    world = pp.init()
    with world:
        rng = np.random.default_rng(7)
        x = rng.standard_normal((24, 8)).astype(np.float32)
        y = rng.standard_normal((24, 1)).astype(np.float32)
        model = DDP(build(world.rank), world.group, reduce_op="sum")  # rank 0's weights win
        optimizer = SGD(model.parameters(), lr=0.1)
        model.attach(optimizer)
        alone = build(0)
        alone_opt = SGD(alone.parameters(), lr=0.1)
        a, b = shard_range(len(x), world.world_size, world.rank)
        for _ in range(3):
            train(model, optimizer, x, y, slice(a, b), len(x))
            train(alone, alone_opt, x, y, slice(0, len(x)), len(x))
        diff = max(
            float(np.abs(p.data - q.data).max()) for p, q in zip(model.parameters(), alone.parameters())
        )
        moved = max(
            float(np.abs(p.data - q.data).max()) for p, q in zip(alone.parameters(), build(0).parameters())
        )
        assert moved > 1e-3, "training did not change the weights"
        assert diff < 1e-5, f"rank {world.rank}: DDP weights differ from one process by {diff}"
        world.barrier()
        seen = {
            "rank": world.rank,
            "world_size": world.world_size,
            "local_rank": world.local_rank,
            "host_id": world.host_id,
            "diff": diff,
            "token_in_env": any(k in os.environ for k in ("PARAMPLANE_TOKEN",)),
        }
        with open(os.path.join(out, f"rank{world.rank}.json"), "w") as f:
            json.dump(seen, f)


if __name__ == "__main__":
    main()
