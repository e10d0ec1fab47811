"""pp.DiLoCo over 3 replicas of one rank each (one emulated host each, gRPC between them): rank 2 is SIGKILLed
inside sync KILL_SYNC's all-reduce after it sent its contribution to rank 0 only. Rank 0 completes the sync,
applies it and, a replica of one rank having no collective between syncs, trains on to the next sync, whose
collective fails; rank 1 never gets the mean and fails at once. After ``world.reform()`` (rank 2 replaced)
``rejoin`` must roll rank 0's sync back keeping its local progress since, redo that sync with the
replacement (rank 1 at its own, earlier step count) and the next one, after which every rank agrees.

Each rank checks its parameters after the rejoin and after every later step against ``simulate`` below (the
same inner steps in one process, the outer Nesterov SGD written out) and reports a digest at the end.
Environment: H, STEPS, KILL_SYNC.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, digest, run_rank
from diloco import data, make_model, train_step

import paramplane as pp
import paramplane.parallel.diloco as diloco_module
from paramplane.node.algorithms import ring
from paramplane.optim import SGD

LR, MOM = 0.7, 0.9  # DiLoCo's default outer optimizer: Nesterov SGD


def wait_for(marker: Path) -> None:
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # polls a file rank 0 writes once it holds the mean; bounded


def kill_inside_sync(world: Any, d: Any, number: int, marker: Path) -> None:
    """Rank 2 sends its share of sync ``number``'s all-reduce (a direct exchange: 600 bytes) to rank 0
    only and dies once rank 0 holds the mean; rank 0 writes the marker then."""
    start_mean, direct_reduce = diloco_module.start_mean, ring.direct_reduce
    armed = False

    def send_to_rank_0_only(ch: Any, spec: Any, flat: Any, bounds: Any, op: str) -> None:
        if not armed:
            return direct_reduce(ch, spec, flat, bounds, op)
        a, b = bounds[0]
        ch.send(0, spec, 0, flat[a:b])
        ch.flush()
        wait_for(marker)
        os.kill(os.getpid(), signal.SIGKILL)

    def patched(group: Any, flat: Any, wire: Any) -> Callable[[], Any]:
        nonlocal armed
        armed = d.step // d.interval == number and world.rank == 2
        done = start_mean(group, flat, wire)

        def finished() -> Any:
            mean = done()
            if world.rank == 0 and d.step // d.interval == number:
                marker.touch()
            return mean

        return finished

    diloco_module.start_mean = patched  # type: ignore[assignment]
    ring.direct_reduce = send_to_rank_0_only  # type: ignore[assignment]


def simulate(h: int, steps: int, kill_sync: int) -> list[dict[int, list[np.ndarray]]]:
    """Each replica's parameters by step count (after the step and its sync), from the rejoin on."""
    models = [make_model() for _ in range(3)]
    opts = [SGD(m.parameters(), lr=0.1) for m in models]
    reps = [[p.data for p in m.parameters()] for m in models]
    last = [a.copy() for a in reps[0]]
    buf: list[Any] = [None] * len(last)

    def outer(grads: list[list[np.ndarray]]) -> list[np.ndarray]:
        """Nesterov SGD on the mean outer gradient; updates ``buf`` and ``last``, returns the new values."""
        for i in range(len(last)):
            g = np.mean([gr[i] for gr in grads], axis=0)
            buf[i] = g.copy() if buf[i] is None else MOM * buf[i] + g
            last[i] = last[i] - LR * (g + MOM * buf[i])
        return [a.copy() for a in last]

    def train(r: int, step: int) -> None:
        train_step(models[r], opts[r], *data(step, r))

    def set_to(r: int, values: list[np.ndarray]) -> None:
        for p, v in zip(reps[r], values, strict=True):
            p[...] = v

    def grads(rs: list[int]) -> list[list[np.ndarray]]:
        return [[a - p for a, p in zip(last, reps[r], strict=True)] for r in rs]

    out: list[dict[int, list[np.ndarray]]] = [{}, {}, {}]
    fail = kill_sync * h  # the step count of the sync rank 2 dies in
    for step in range(fail):
        for r in range(3):
            train(r, step)
        if (step + 1) % h == 0 and step + 1 < fail:
            new = outer(grads([0, 1, 2]))
            for r in range(3):
                set_to(r, new)
    saved_last, saved_buf = [a.copy() for a in last], [None if b is None else b.copy() for b in buf]
    before = [a.copy() for a in reps[0]]
    applied = outer(grads([0, 1, 2]))  # what rank 0 applied (every replica's contribution)
    set_to(0, applied)
    for step in range(fail, fail + h):  # rank 0 trains on to the next sync
        train(0, step)
    progress = [p - a for p, a in zip(reps[0], applied, strict=True)]
    last[:], buf[:] = saved_last, saved_buf  # rolled back; redone with the replacement (from last: zero)
    zero = [np.zeros_like(a) for a in last]
    redone = [
        np.mean([a - b, a - p, z], axis=0) for a, b, p, z in zip(last, before, reps[1], zero, strict=True)
    ]
    new = outer([redone])
    set_to(0, [n + d for n, d in zip(new, progress, strict=True)])
    set_to(1, new)
    set_to(2, new)
    out[1][fail] = [a.copy() for a in new]
    for step in range(fail, steps):
        for r in range(3):
            if r == 1 or step >= fail + h:  # ranks 0 and 2 wait in the redone next sync for rank 1
                train(r, step)
        if (step + 1) % h == 0:
            new = outer(grads([0, 1, 2]))
            for r in range(3):
                set_to(r, new)
        for r in range(3):
            if r == 1 or step + 1 >= fail + h:
                out[r][step + 1] = [a.copy() for a in reps[r]]
    return out


def scenario(world: Any, rep: Report) -> None:
    h, num_steps, kill_sync = int(os.environ["H"]), int(os.environ["STEPS"]), int(os.environ["KILL_SYNC"])
    replacement = os.environ.get("PARAMPLANE_REPLACEMENT") == "1"
    model = make_model(seed=50 if replacement else 3)
    opt = SGD(model.parameters(), lr=0.1)
    d = pp.DiLoCo(model, opt, world.group, sync_every=h, init_sync=not replacement)
    if not replacement:
        kill_inside_sync(world, d, kill_sync, Path(os.environ["PARAMPLANE_TEST_OUT"]) / "rank0-has-mean")
    step, resumed = 0, None
    if replacement:
        step = resumed = d.rejoin(has_state=False)
    mine: dict[int, list[np.ndarray]] = {}
    if replacement:
        mine[step] = [p.data.copy() for p in model.parameters()]
    while step < num_steps:
        try:
            train_step(model, opt, *data(step, world.rank))
            step += 1
        except pp.PlaneError as exc:
            rep.values.setdefault("errors", []).append(f"{type(exc).__name__} at step {d.step}: {exc}")
            rep.values["failed_at"], rep.values["applied_before_rejoin"] = d.step, d.num_applied
            opt.zero_grad()
            world.reform(timeout=60)
            step = resumed = d.rejoin(has_state=True)
        mine[step] = [p.data.copy() for p in model.parameters()]
    rep.values["resumed_at"], rep.values["applied"] = resumed, d.num_applied
    if resumed is None:
        rep.check("the loss was noticed", False, "no PlaneError on a survivor")
        return
    want = simulate(h, num_steps, kill_sync)[world.rank]
    for s, params in sorted(mine.items()):
        if s >= resumed:
            rep.check(f"step {s} simulated", s in want, str(sorted(want)))
            for i, p in enumerate(params):
                rep.equal(f"step {s} param {i}", p, want[s][i], rtol=1e-10)
    rep.check("step count", d.step == num_steps, str(d.step))
    rep.digests["end"] = digest(np.concatenate([a.ravel() for a in mine[num_steps]]))


if __name__ == "__main__":
    run_rank(scenario)
