"""A torch-stage pipeline world that exits with its pipelines alive (the interpreter tears them down).

Usage: ``pipeline_exit.py N``: N ``pp.Pipeline``s of a torch Linear stage over the world (2 ranks), one step
each, kept in a module global until the interpreter exits. Before the transfer threads stopped holding the last
message they sent and stopped being woken at exit, this aborted a rank in most runs ("terminate called without
an active exception": torch's deleter, run on one of those threads while the interpreter tore down).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp

KEEP: list[Any] = []


def scenario(world: Any, rep: Report) -> None:
    import torch

    torch.manual_seed(0)
    for _ in range(int(sys.argv[1])):
        pipe = pp.Pipeline(
            torch.nn.Linear(256, 256), world.group, "1f1b", 4, loss_fn=torch.nn.functional.mse_loss
        )
        x = torch.zeros(64, 256)
        losses = pipe.step(x if pipe.is_first else None, x if pipe.is_last else None)
        rep.check("a step", (losses is not None) == pipe.is_last, str(losses))
        KEEP.append(pipe)


if __name__ == "__main__":
    run_rank(scenario)
