"""``pp.ShardedGradScaler`` under pp.FSDP (transformers' GPT-2, full_shard, float64, world 2).

At step 1 rank 1's loss gains a term whose gradient overflows in one element only (the final LayerNorm's first
bias): after the reduce-scatter the inf lies in the one shard that holds it. With torch's own
``torch.amp.GradScaler`` that rank skips its step and halves its scale while the other steps: the scales part
(checked, so the scenario does what it claims). With ``pp.ShardedGradScaler`` every rank skips step 1 and keeps
one scale, and the scale, every step's loss and the final parameters equal one process with torch's scaler on
the whole batch; a scaler without a ProcessGroup is a ValueError.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, digest, run_rank

import paramplane as pp

STEPS = 3
OVERFLOW = (1, 1)  # (step, rank): where the loss gains a term whose gradient overflows


def _big() -> float:
    import torch

    return float(torch.finfo(torch.float64).max)


def _train(world: Any, scaler: Any, steps: int = STEPS) -> tuple[Any, Any, list[float]]:
    """pp.FSDP with ``scaler``: unscale, the global clip, step, update; returns the model, the FSDP, the losses."""
    import torch

    model = tm.build("gpt2", seed=0)
    fsdp = pp.FSDP(model, world.group, "full_shard")
    extra: list[Any] = []
    # Read inside the forward, where the root unit is gathered; its gradient is _big() times the loss scale.
    model.transformer.ln_f.register_forward_hook(lambda m, _a, _o: extra.append(m.bias[0] * _big()))
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        extra.clear()
        loss = fsdp(**tm.batch("gpt2", step, world.rank)).loss
        losses.append(float(loss))
        if (step, world.rank) == OVERFLOW:
            loss = loss + extra[0]
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        fsdp.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model, fsdp, losses


def _reference(num_ranks: int) -> tuple[Any, Any, list[list[float]]]:
    """One process on every rank's batch with torch's scaler: the mean of the ranks' losses (FSDP's mean)."""
    import torch

    ref = tm.build("gpt2", seed=0)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for step in range(STEPS):
        per_rank = [ref(**tm.batch("gpt2", step, r)).loss for r in range(num_ranks)]
        losses.append([float(x) for x in per_rank])
        total = sum(per_rank) / num_ranks
        if step == OVERFLOW[0]:
            total = total + ref.transformer.ln_f.bias[0] * _big() / num_ranks
        scaler.scale(total).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return ref, scaler, losses


def scenario(world: Any, rep: Report) -> None:
    import torch

    n = world.world_size
    _train(world, plain := torch.amp.GradScaler("cpu"), steps=OVERFLOW[0] + 1)
    scales = world.group.all_gather(np.array([plain.get_scale()]))
    rep.check(
        "torch's own scaler: the ranks' scales part at the overflow",
        scales.min() != scales.max(),
        str(scales),
    )

    scaler = pp.ShardedGradScaler("cpu", process_group=world.group)
    model, fsdp, losses = _train(world, scaler)
    ref, ref_scaler, ref_losses = _reference(n)
    rep.check("the scale equals one process's", scaler.get_scale() == ref_scaler.get_scale(),
              f"{scaler.get_scale()} vs {ref_scaler.get_scale()}")  # fmt: skip
    rep.close("every step's loss", np.array(losses), np.array([s[world.rank] for s in ref_losses]), 1e-9)
    with fsdp.summon_full_params():
        rep.close("parameters after the skipped step", tm.flat_params(model), tm.flat_params(ref), 1e-9)
    rep.digests["params"] = digest(fsdp.state_dict()["lm_head.weight"].numpy())
    try:
        pp.ShardedGradScaler("cpu", process_group=None)
        rep.check("no ProcessGroup", False, "no error")
    except ValueError as e:
        rep.check("no ProcessGroup", "needs a group" in str(e), str(e))


if __name__ == "__main__":
    run_rank(scenario)
