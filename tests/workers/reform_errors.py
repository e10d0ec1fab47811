"""``pp.checkpoint.sync`` refusals, on two ranks: each check expects CheckpointError on every rank with the
problem named, and the receiving rank's state unchanged afterwards."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp
from paramplane.checkpoint import CheckpointError
from paramplane.nn import Linear
from paramplane.optim import SGD


def scenario(world: Any, rep: Report) -> None:
    g = world.group
    source = g.rank == 0
    rep.raises(
        "no rank has state",
        CheckpointError,
        lambda: pp.checkpoint.sync({"step": 0}, g, has_state=False),
        "no rank of the group has state",
    )
    # A different model on the receiver: a wrong shape.
    model = Linear(4, 3 if source else 5, dtype=np.float64, rng=g.rank)
    before = {k: v.copy() for k, v in model.state_dict().items()}
    rep.raises(
        "wrong shape",
        CheckpointError,
        lambda: pp.checkpoint.sync({"model": model, "step": 7}, g, has_state=source),
        "cannot sync from group rank 0",
        "'model/weight'",
    )
    for k, v in model.state_dict().items():
        rep.equal(f"unchanged {k}", v, before[k])
    # A missing key: the receiver's state has a key the source's does not.
    state: dict[str, Any] = {"step": 1} if source else {"step": 1, "extra": np.zeros(2)}
    rep.raises(
        "missing key", CheckpointError, lambda: pp.checkpoint.sync(state, g, has_state=source), "'extra'"
    )
    # Shards of different ranges are not replicas.
    shard = pp.parallel.sharding.ShardedArray((8,), 4 * g.rank, np.zeros(4))
    rep.raises(
        "different layout",
        CheckpointError,
        lambda: pp.checkpoint.sync({"w": _Sharded(shard)}, g, has_state=source),
        "same layout",
    )
    # What fits is moved: a fresh optimizer on the receiver gets the source's state and the step.
    fit = Linear(4, 3, dtype=np.float64, rng=g.rank)
    opt = SGD(fit.parameters(), lr=0.1, momentum=0.9)
    if source:
        for p in fit.parameters():
            p.grad = np.ones_like(p.data)
        opt.step()
    values = pp.checkpoint.sync(
        {"model": fit, "optim": opt, "step": 11 if source else 0}, g, has_state=source
    )
    rep.check("step moved", values["step"] == 11, str(values))
    weights = np.array(fit.state_dict()["weight"])
    every = g.all_gather(weights.reshape(1, -1))
    rep.equal("weights agree", every[1], every[0])
    rep.check("optimizer state moved", bool(opt.state_dict()), "receiver's optimizer has no state")


class _Sharded:
    def __init__(self, piece: Any) -> None:
        self.piece = piece

    def sharded_state_dict(self) -> dict[str, Any]:
        return {"w": self.piece}

    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        pass


if __name__ == "__main__":
    run_rank(scenario)
