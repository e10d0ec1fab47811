"""In-process recovery of a torch training loop: transformers' GPT-2 under pp.DDP with torch's AdamW loses a rank;
the survivors catch the PlaneError that ``loss.backward()`` raises, ``world.reform()``, and a replacement
(other initial weights, a fresh optimizer) receives the parameters and the optimizer state live through
``pp.checkpoint.sync({"model": ddp, "optim": ddp.optim_state(opt), "step": step}, ...)``.

Environment: FAIL_AT (step at whose start rank 1 exits; -1: never), STEPS, WRAPPER (ddp, or hybrid_shard: pp.FSDP
whose replacement gets its parameter and optimizer shards from its replica over ``fsdp.replicate_group``, after
``fsdp.reform()`` on the survivors). Each rank reports digests of its final parameters (and, under ddp, of its
optimizer state: FSDP shards differ by rank), the epoch it ended in and the step it resumed at.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, digest, run_rank

import paramplane as pp


def scenario(world: Any, rep: Report) -> None:
    import torch

    fail_at, num_steps = int(os.environ["FAIL_AT"]), int(os.environ["STEPS"])
    replacement = os.environ.get("PARAMPLANE_REPLACEMENT") == "1"
    model = tm.build("gpt2", seed=7 if replacement else 0)
    wrapper = os.environ.get("WRAPPER", "ddp")
    if wrapper == "ddp":
        ddp: Any = pp.DDP(model, world.group, init_sync=not replacement)
    else:
        ddp = pp.FSDP(model, world.group, wrapper, sync_module_states=not replacement)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)

    def state(step: int) -> dict[str, Any]:
        return {"model": ddp, "optim": ddp.optim_state(opt), "step": step}

    def replicas() -> Any:
        return world.group if wrapper == "ddp" else ddp.replicate_group

    def clip() -> None:
        if wrapper == "ddp":
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        else:
            ddp.clip_grad_norm_(1.0)

    step = 0
    if replacement:
        step = pp.checkpoint.sync(state(0), replicas(), has_state=False)["step"]
        rep.values["resumed_at"] = step
    while step < num_steps:
        if step == fail_at and world.rank == 1 and not replacement:
            os._exit(3)
        try:
            ddp(**tm.batch("gpt2", step, world.rank)).loss.backward()
            clip()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
        except pp.PlaneError as exc:
            rep.values.setdefault("errors", []).append(f"{type(exc).__name__} at step {step}: {exc}")
            opt.zero_grad(set_to_none=True)
            world.reform(timeout=60)
            if wrapper != "ddp":
                ddp.reform()
            step = pp.checkpoint.sync(state(step), replicas(), has_state=True)["step"]
            rep.values["resumed_at"] = step
    rep.values["epoch"] = world.epoch
    rep.values["rank_after"] = world.rank
    for name, value in ddp.state_dict().items():
        rep.digests[f"param {name}"] = digest(value.numpy())
    if wrapper != "ddp":  # shards differ across shard ranks: the full state only
        return
    for i, p in enumerate(ddp.parameters()):
        for name, value in sorted(opt.state[p].items()):
            rep.digests[f"optim {i} {name}"] = digest(value.numpy())


if __name__ == "__main__":
    run_rank(scenario)
