"""DDP training that survives a lost rank in process: survivors ``world.reform()``, a replacement joins and
receives the parameters and optimizer state live (``pp.checkpoint.sync``), and training goes on.

Environment: FAIL_AT (step at whose start rank 1 exits; -1: never), STEPS, WRAPPER (ddp, or an FSDP
strategy: the replacement then gets its shards from its replicas over ``fsdp.replicate_group``). The replacement
(PARAMPLANE_REPLACEMENT=1, started by the harness once rank 1 has exited) builds its model from another
seed, so only the live transfer can make it agree with the survivors. Each rank reports a digest of every
final parameter and of the optimizer's state, the epoch it ended in and the step it resumed at.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, digest, run_rank

import paramplane as pp
from paramplane.nn import Linear, MSELoss, ReLU, Sequential
from paramplane.optim import AdamW


def scenario(world: Any, rep: Report) -> None:
    fail_at, num_steps = int(os.environ["FAIL_AT"]), int(os.environ["STEPS"])
    replacement = os.environ.get("PARAMPLANE_REPLACEMENT") == "1"
    seed = 100 if replacement else 1
    model = Sequential(
        Linear(6, 8, dtype=np.float64, rng=seed), ReLU(), Linear(8, 2, dtype=np.float64, rng=seed + 1)
    )
    wrapper = os.environ.get("WRAPPER", "ddp")
    if wrapper == "ddp":
        ddp: Any = pp.DDP(model, world.group, init_sync=not replacement)
    else:
        ddp = pp.FSDP(model, world.group, strategy=wrapper, sync_module_states=not replacement)
    opt = AdamW(ddp.parameters(), lr=0.05)
    ddp.attach(opt)

    def replicas() -> Any:
        return world.group if wrapper == "ddp" else ddp.replicate_group

    crit = MSELoss()
    step = 0
    if replacement:
        state = {"model": ddp, "optim": opt, "step": 0}
        step = pp.checkpoint.sync(state, replicas(), has_state=False)["step"]
        rep.values["resumed_at"] = step
    while step < num_steps:
        if step == fail_at and world.rank == 1 and not replacement:
            os._exit(3)
        try:
            rng = np.random.default_rng(step * 10 + world.rank)
            crit.forward(ddp.forward(rng.standard_normal((4, 6))), rng.standard_normal((4, 2)))
            ddp.backward(crit.backward())
            opt.step()
            opt.zero_grad()
            step += 1
        except pp.PlaneError as exc:
            rep.values.setdefault("errors", []).append(f"{type(exc).__name__} at step {step}: {exc}")
            opt.zero_grad()
            world.reform(timeout=60)
            if wrapper != "ddp":
                ddp.reform()
            state = {"model": ddp, "optim": opt, "step": step}
            step = pp.checkpoint.sync(state, replicas(), has_state=True)["step"]
            rep.values["resumed_at"] = step
    rep.values["epoch"] = world.epoch
    rep.values["rank_after"] = world.rank
    for name, value in ddp.state_dict().items():
        rep.digests[f"param {name}"] = digest(value)
    if wrapper != "ddp":  # shards differ across shard ranks: compare the full, gathered state only
        return
    for name, value in opt.sharded_state_dict().items():
        rep.digests[f"optim {name}"] = digest(value) if isinstance(value, np.ndarray) else repr(value)


if __name__ == "__main__":
    run_rank(scenario)
