"""A small training-like job for the live view: an all-reduce per step, reported with ``world.report``.

Runs until the file ``$PARAMPLANE_TEST_STOP`` exists (or 120 s pass), then leaves cleanly. The 20 ms pause per
step stands in for compute so that the job does not take both cores of a test machine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

import paramplane as pp

STEP_S = 0.02

world = pp.init(timeout=60)
stop = Path(os.environ["PARAMPLANE_TEST_STOP"])
x = np.ones(4096, dtype=np.float32)
deadline = time.monotonic() + 120
step = 0
while True:
    # The last element votes to stop, so that every rank leaves after the same step.
    x[-1] = 1.0 if stop.exists() or time.monotonic() > deadline else 0.0
    world.group.all_reduce(x)
    assert x[0] == world.world_size, x[0]
    step += 1
    world.report(step=step, loss=1.0 / step, tokens=256)
    if x[-1] > 0:
        break
    x.fill(1.0)
    time.sleep(STEP_S)
world.shutdown()
