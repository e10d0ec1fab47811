"""Rank worker for tests/test_ddp.py (2 ranks): ranks that wrap different models with the same number of
elements get a CollectiveMismatch naming the parameter when DDP wraps them, before any training."""

from __future__ import annotations

from typing import Any

from _common import Report, run_rank

import paramplane as pp
from paramplane.nn import Linear


def scenario(world: Any, rep: Report) -> None:
    model = Linear(6, 2, bias=False, rng=0) if world.rank == 0 else Linear(4, 3, bias=False, rng=0)
    rep.raises(
        "different models", pp.CollectiveMismatch, lambda: pp.DDP(model, world.group), "'weight'", "DDP"
    )


if __name__ == "__main__":
    run_rank(scenario)
