"""pp.DiLoCo over 2 replicas of 2 ranks (FSDP full_shard inside each emulated host) losing a whole replica
(ranks 2 and 3) and getting it back through ``world.reform()``, ``fsdp.reform(...)`` and ``diloco.rejoin``.

MODE=between: ranks 2 and 3 exit at the start of inner step FAIL_AT (between syncs); the survivors notice at
the next sync. MODE=in_sync: ranks 2 and 3 are SIGKILLed inside sync number KILL_SYNC's collective, so that
rank 0 completes it (its partner, rank 2, sends everything and dies only once rank 0 has the mean) while rank
1 never does (rank 3 dies before contributing): survivors split; rank 0 applied the sync, rank 1 not.

Each rank checks the full parameters (gathered in its host) after every later step against a single-process
simulation in which replica 1 restarts from the last sync all agree on (tests/workers/diloco_reform.py's
``simulate``), and reports digests of the full parameters after the rejoin and at the end.
Environment: MODE, FAIL_AT, KILL_SYNC, STEPS, H, FRAGMENTS, OVERLAP (0/1).
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
from diloco_reform import simulate

import paramplane as pp
import paramplane.parallel.diloco as diloco_module
from paramplane.optim import SGD

DIMS = [("replicate", 2), ("shard", 2)]


def host_batch(step: int, host: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = data(step, 2 * host), data(step, 2 * host + 1)
    return np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])


def kill_inside_sync(world: Any, d: Any, number: int, marker: Path) -> None:
    """Make sync ``number``'s collective end as the module docstring says (``MODE=in_sync``)."""
    start_mean = diloco_module.start_mean

    def wait_for_marker() -> None:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # polls a file rank 0 writes; bounded

    def patched(group: Any, flat: Any, wire: Any) -> Callable[[], Any]:
        if d.step // d.interval != number or os.environ.get("PARAMPLANE_REPLACEMENT") == "1":
            return start_mean(group, flat, wire)
        if world.rank == 3:  # dies before contributing: rank 1 never gets the mean
            wait_for_marker()
            os.kill(os.getpid(), signal.SIGKILL)
        done = start_mean(group, flat, wire)

        def finished() -> Any:
            try:
                mean = done()
                if world.rank == 0:
                    marker.touch()
                return mean
            finally:
                if world.rank == 2:  # it sent its share; dies once rank 0 has the mean
                    wait_for_marker()
                    os.kill(os.getpid(), signal.SIGKILL)

        return finished

    diloco_module.start_mean = patched  # type: ignore[assignment]


def scenario(world: Any, rep: Report) -> None:
    mode, num_steps = os.environ["MODE"], int(os.environ["STEPS"])
    h, k, overlap = int(os.environ["H"]), int(os.environ["FRAGMENTS"]), os.environ["OVERLAP"] == "1"
    replacement = os.environ.get("PARAMPLANE_REPLACEMENT") == "1"
    fail_at, kill_sync = int(os.environ.get("FAIL_AT", "-1")), int(os.environ.get("KILL_SYNC", "-1"))
    mesh = pp.Mesh(world.group, dims=DIMS)
    fsdp = pp.FSDP(
        make_model(seed=50 if replacement else 3),
        mesh.group("shard"),
        strategy="full_shard",
        sync_module_states=not replacement,
    )
    opt = SGD(fsdp.parameters(), lr=0.1)
    fsdp.attach(opt)
    d = pp.DiLoCo(
        fsdp, opt, mesh.group("replicate"), h, fragments=k, overlap=overlap, init_sync=not replacement
    )
    if mode == "in_sync":
        kill_inside_sync(world, d, kill_sync, Path(os.environ["PARAMPLANE_TEST_OUT"]) / "rank0-has-mean")
    step, resumed = 0, None
    if replacement:
        step = resumed = d.rejoin(has_state=False)
        rep.digests["after rejoin"] = digest(np.concatenate([a.ravel() for a in fsdp.state_dict().values()]))
    mine: dict[int, list[np.ndarray]] = {}
    while step < num_steps:
        if mode == "between" and step == fail_at and world.rank >= 2 and not replacement:
            os._exit(3)
        try:
            train_step(fsdp, opt, *data(step, world.rank))
            step += 1
            mine[step] = [np.asarray(a).copy() for a in fsdp.state_dict().values()]
        except pp.PlaneError as exc:
            rep.values.setdefault("errors", []).append(f"{type(exc).__name__} at step {step}: {exc}")
            rep.values["applied_before_rejoin"] = d.num_applied
            opt.zero_grad()
            world.reform(timeout=60)
            mesh = pp.Mesh(world.group, dims=DIMS)
            fsdp.reform(mesh.group("shard"))
            step = resumed = d.rejoin(mesh.group("replicate"), has_state=True)
            full = fsdp.state_dict()
            rep.digests["after rejoin"] = digest(np.concatenate([a.ravel() for a in full.values()]))
            mine[step] = [np.asarray(a).copy() for a in full.values()]
    d.finish()
    mine[num_steps + 1] = [np.asarray(a).copy() for a in fsdp.state_dict().values()]
    rep.values["resumed_at"] = resumed
    rep.values["applied"] = d.num_applied
    if resumed is None:
        rep.check("the loss was noticed", False, "no PlaneError on a survivor")
        return
    lost_from = fail_at if mode == "between" else kill_sync * h // k - 1  # replica 1's steps lost from here
    want = simulate(2, num_steps, h, k, overlap, 1, lost_from, resumed, host_batch)
    host = world.rank // 2
    for s, params in sorted(mine.items()):
        if s >= resumed:
            for i, p in enumerate(params):
                rep.equal(f"step {s} param {i}", p, want[s - 1][host][i], rtol=1e-10)
    rep.check("step count", d.step == num_steps, str(d.step))
    rep.digests["end"] = digest(np.concatenate([a.ravel() for a in mine[num_steps + 1]]))


if __name__ == "__main__":
    run_rank(scenario)
