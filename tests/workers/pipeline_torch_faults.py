"""Faults in a pipeline of torch stages (2 ranks, 1F1B, 4 microbatches), whose messages the receiver threads
turn into tensors: the errors stay the group's, typed, on both stages, within the deadline.

Usage: ``pipeline_torch_faults.py SCENARIO`` with SCENARIO ``bad_shape`` (stage 0's output changes shape at
microbatch 2: CollectiveMismatch on both ranks, and again on the next step) or ``kill`` (rank 1 dies in its
first forward: PeerLost naming it on rank 0).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp

M, PER_MB, WIDTH = 4, 2, 6


class Stage:
    """A torch Linear stage whose forward can be made to misbehave at a given call."""

    def __init__(self, rank: int, misbehave: str) -> None:
        import torch

        class Drifting(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = torch.nn.Linear(WIDTH, WIDTH, dtype=torch.float64)
                self.calls = 0

            def forward(self, x: Any) -> Any:
                self.calls += 1
                y = self.linear(x)
                if misbehave == "grow" and self.calls == 3:
                    return torch.cat([y, y[:1]])
                if misbehave == "die":
                    os._exit(9)
                return y

        torch.manual_seed(rank)
        self.module = Drifting()


def scenario(world: Any, rep: Report) -> None:
    import torch

    g, what = world.group, sys.argv[1]
    misbehave = {("bad_shape", 0): "grow", ("kill", 1): "die"}.get((what, g.rank), "")
    stage = Stage(g.rank, misbehave).module
    pipe = pp.Pipeline(stage, g, "1f1b", M, loss_fn=torch.nn.functional.mse_loss)
    x = torch.ones(M * PER_MB, WIDTH, dtype=torch.float64)

    def step() -> Any:
        return pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)

    if what == "bad_shape":
        rep.raises("shape change at microbatch 2", pp.CollectiveMismatch, step, "shape")
        rep.raises("the next step fails at once with the group's error", pp.CollectiveMismatch, step, "shape")
    elif what == "kill":
        rep.raises("peer lost", pp.PeerLost, step, "rank 1")
    else:
        raise ValueError(f"unknown scenario {what!r}")


if __name__ == "__main__":
    run_rank(scenario)
