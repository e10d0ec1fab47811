"""Pipelines on cupy arrays: activations leave the device for the wire on the stage's stream and come back
to it; 1F1B and interleaved 1F1B (groups of 2 and 4) equal the unpipelined numpy model in every gradient."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank
from pipeline import CLASSES, IN, PER_MB, stage_module

import paramplane as pp
from paramplane.nn import CrossEntropyLoss, Sequential


def scenario(world: Any, rep: Report) -> None:
    import cupy

    world.use_gpu()
    g = world.group
    p, m = g.size, 8
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((m * PER_MB, IN)), rng.integers(0, CLASSES, m * PER_MB)
    for schedule, v, group in (("1f1b", 1, None), ("interleaved_1f1b", 2, None), ("interleaved_1f1b", 2, 4)):
        stages = p * v
        mine = list(range(g.rank, stages, p))
        modules = [stage_module(s, stages).to(cupy) for s in mine]
        pipe = pp.Pipeline(
            modules if v > 1 else modules[0], g, schedule, m, CrossEntropyLoss(), microbatch_group=group
        )
        xd, yd = cupy.asarray(x), cupy.asarray(y)
        losses = pipe.step(xd if g.rank == 0 else None, yd if pipe.is_last else None)
        ref = Sequential(*[stage_module(s, stages) for s in range(stages)])
        crit = CrossEntropyLoss()
        crit.forward(ref.forward(x), y)
        ref.backward(crit.backward())
        name = f"{schedule} groups {group or p}"
        for s, module in zip(mine, modules):
            for (pname, got), (_, want) in zip(module.named_parameters(), ref[s].named_parameters()):
                rep.check(f"{name}: stage {s} {pname} grad on the device", isinstance(got.grad, cupy.ndarray))
                rep.equal(f"{name}: stage {s} {pname} grad", cupy.asnumpy(got.grad), want.grad, rtol=1e-10)
        if pipe.is_last:
            rep.check(f"{name}: {m} losses", losses is not None and len(losses) == m, str(losses))


if __name__ == "__main__":
    run_rank(scenario)
