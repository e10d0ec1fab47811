"""A DDP job that checkpoints every step and resumes from the newest checkpoint (for launch --max-restarts).

Usage: ``restart.py OUT [FAIL_AT]``: on the first attempt (PARAMPLANE_RESTART_COUNT=0) rank 1 dies at the
start of step FAIL_AT; every attempt resumes from ``pp.checkpoint.latest``; rank 0 writes the final
parameters to OUT/final.npz.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

import paramplane as pp
from paramplane.nn import Linear, MSELoss, ReLU, Sequential
from paramplane.optim import AdamW

STEPS = 8


def main() -> None:
    out = Path(sys.argv[1])
    fail_at = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    attempt = int(os.environ["PARAMPLANE_RESTART_COUNT"])
    with pp.init() as world:
        model = pp.DDP(
            Sequential(Linear(6, 8, dtype=np.float64, rng=1), ReLU(), Linear(8, 2, dtype=np.float64, rng=2)),
            world.group,
        )
        opt = AdamW(model.parameters(), lr=0.05)
        model.attach(opt)
        start = 0
        latest = pp.checkpoint.latest(out / "ckpt")
        if latest is not None:
            start = pp.checkpoint.load({"model": model, "optim": opt, "step": 0}, latest, world.group)["step"]
        crit = MSELoss()
        for step in range(start, STEPS):
            if step == fail_at and attempt == 0 and world.rank == 1:
                os._exit(3)
            rng = np.random.default_rng(step * 10 + world.rank)
            crit.forward(model.forward(rng.standard_normal((4, 6))), rng.standard_normal((4, 2)))
            model.backward(crit.backward())
            opt.step()
            opt.zero_grad()
            pp.checkpoint.save(
                {"model": model, "optim": opt, "step": step + 1},
                out / "ckpt" / f"step_{step + 1}",
                world.group,
                keep=2,
            )
        if world.rank == 0:
            np.savez(out / "final.npz", **model.state_dict())
            print(f"attempt {attempt} resumed at step {start}", flush=True)


if __name__ == "__main__":
    main()
