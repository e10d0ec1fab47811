"""pp.DiLoCo surviving a lost replica: rank VICTIM exits at the start of inner step FAIL_AT (between syncs),
the survivors notice at the next sync (PeerLost from ``opt.step()``), ``world.reform()``, and every rank calls
``diloco.rejoin``; the replacement (PARAMPLANE_REPLACEMENT=1, other initial weights) gets ``last``, the outer
optimizer's state and the step count live and restarts from the last sync. Each rank checks its parameters
at every later step against a single-process simulation (tests/workers/diloco.py's ``Sim``) in which the lost
replica's parameters are the last synced ones from its loss until the rejoin and it skips those steps.

Environment: FAIL_AT, STEPS, H, FRAGMENTS, OVERLAP (0/1), VICTIM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, digest, run_rank
from diloco import Sim, data, make_model, train_step

import paramplane as pp
from paramplane.optim import SGD


def simulate(
    replicas: int,
    steps: int,
    h: int,
    k: int,
    overlap: bool,
    victim: int,
    fail_at: int,
    resumed: int,
    batch_of: Callable[[int, int], tuple[np.ndarray, np.ndarray]] = data,
) -> list[list[list[np.ndarray]]]:
    """Every replica's parameters after each inner step; replica ``victim`` is lost at the start of step
    ``fail_at`` and back (from ``last``) with ``resumed`` steps done; ``batch_of(step, replica)`` its data.
    The last entry: after ``finish()``."""
    models = [make_model() for _ in range(replicas)]
    opts = [SGD(m.parameters(), lr=0.1) for m in models]
    sim = Sim([[p.data for p in m.parameters()] for m in models], h, k, overlap, 0.7, 0.9)
    out = []
    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts, strict=True)):
            if r == victim and fail_at <= step < resumed:
                for p, last in zip(m.parameters(), sim.last, strict=True):
                    p.data[...] = last  # lost: the replacement starts from the last sync
            else:
                train_step(m, o, *batch_of(step, r))
        sim.after_inner()
        out.append([[p.data.copy() for p in m.parameters()] for m in models])
    if sim.pending is not None:  # DiLoCo.finish(): apply the sync still in flight
        sim._apply(*sim.pending)
    out.append([[p.data.copy() for p in m.parameters()] for m in models])
    return out


def scenario(world: Any, rep: Report) -> None:
    fail_at, num_steps = int(os.environ["FAIL_AT"]), int(os.environ["STEPS"])
    h, k, overlap = int(os.environ["H"]), int(os.environ["FRAGMENTS"]), os.environ["OVERLAP"] == "1"
    victim = int(os.environ["VICTIM"])
    replacement = os.environ.get("PARAMPLANE_REPLACEMENT") == "1"
    model = make_model(seed=50 if replacement else 3)
    opt = SGD(model.parameters(), lr=0.1)
    d = pp.DiLoCo(
        model, opt, world.group, sync_every=h, fragments=k, overlap=overlap, init_sync=not replacement
    )
    step, resumed = 0, None
    if replacement:
        step = resumed = d.rejoin(has_state=False)
    mine: dict[int, list[np.ndarray]] = {}
    while step < num_steps:
        if step == fail_at and world.rank == victim and not replacement:
            os._exit(3)
        try:
            train_step(model, opt, *data(step, world.rank))
            step += 1
        except pp.PlaneError as exc:
            rep.values.setdefault("errors", []).append(f"{type(exc).__name__} at step {step}: {exc}")
            opt.zero_grad()
            world.reform(timeout=60)
            step = resumed = d.rejoin(has_state=True)
        mine[step] = [p.data.copy() for p in model.parameters()]
    d.finish()
    mine[num_steps + 1] = [p.data.copy() for p in model.parameters()]  # after finish()
    rep.values["resumed_at"] = resumed
    rep.check("the loss was noticed", resumed is not None, "no PlaneError on a survivor")
    if resumed is None:
        return
    rep.check("resumed after the loss", fail_at < resumed <= num_steps, str(resumed))
    want = simulate(world.world_size, num_steps, h, k, overlap, victim, fail_at, resumed)
    for s, params in sorted(mine.items()):
        for i, p in enumerate(params):
            rep.equal(f"step {s} param {i}", p, want[s - 1][world.rank][i], rtol=1e-10)
    rep.check("step count", d.step == num_steps, str(d.step))
    for i, last in enumerate(d.last):
        rep.digests[f"last {i}"] = digest(last)
    for i, slot in d.outer_optimizer.state.items():
        rep.digests[f"outer {i}"] = digest(slot["momentum_buffer"])
    if num_steps % h == 0 and not overlap:  # a whole sync at the end: every replica holds the same
        for i, p in enumerate(model.parameters()):
            rep.digests[f"param {i}"] = digest(p.data)


if __name__ == "__main__":
    run_rank(scenario)
