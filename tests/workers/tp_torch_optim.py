"""A torch optimizer's state over a tensor-parallel model, saved with ``pp.checkpoint`` at one tp size and
loaded at another (``model.optim_state(opt)`` / ``pp.tp_optim_state``).

World 3. Every rank trains the plain transformers GPT-2 (float64, tied embedding; its fused ``c_attn`` and
Conv1D columns are gathered on tp rank 0 in the checkpoint, its row splits written in place) with AdamW for
``STEPS`` steps on one process: the uninterrupted run. Then:

- tp 2 (ranks 0, 1) trains ``SAVED`` steps and saves model and AdamW state; it is loaded at tp 1 (the plain
  model and a fresh AdamW, every rank) and at tp 3 (all ranks, a fresh AdamW);
- tp 1 (the plain model, every rank) trains ``SAVED`` steps and saves; it is loaded at tp 2 and tp 3.

After each load: every loaded ``exp_avg`` / ``exp_avg_sq`` is this rank's piece of the uninterrupted run's
(resharded like its parameter), the step count is restored, and the remaining steps' losses and the final
parameters equal the uninterrupted run's (float64, 1e-9).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank
from tp_torch import batch, build

import paramplane as pp

STEPS, SAVED = 4, 2
TOL = 1e-9  # float64; tp sums in another order, and Adam divides by sqrt(v) (measured: ~1.5e-12)


def opt_for(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model: Any, opt: Any, i: int) -> float:
    loss = model(**batch(i)).loss  # gathered logits: the model's own loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def uninterrupted() -> tuple[list[float], dict[str, Any], dict[str, Any]]:
    """Losses of every step, AdamW's dense state after ``SAVED`` steps, the final parameters."""
    model = build("gpt2", seed=5)
    opt = opt_for(model)
    losses, moments = [], {}
    for i in range(STEPS):
        losses.append(step(model, opt, i))
        if i == SAVED - 1:
            for name, p in model.named_parameters():
                moments[name] = {k: v.clone() for k, v in opt.state[p].items()}
    return losses, moments, {k: v.clone() for k, v in model.state_dict().items()}


def model_at(tp: Any, seed: int) -> Any:
    """GPT-2 (seed 5: the uninterrupted run's start; another: the checkpoint must set everything), split over
    ``tp`` (None: the plain model)."""
    model = build("gpt2", seed=seed)
    if tp is not None:
        pp.parallelize(model, tp, pp.tp_plan_for(model))
    return model


def resume(rep: Report, tag: str, path: Path, tp: Any, group: Any, want: Any) -> None:
    losses, moments, final = want
    model = model_at(tp, 9)
    opt = opt_for(model)
    state = pp.tp_optim_state(model, opt) if tp is None else model.optim_state(opt)
    pp.checkpoint.load({"model": model, "optim": state}, path, group)
    for name, p in model.named_parameters():
        spec = getattr(p, "tp_shard", None)
        for k in ("exp_avg", "exp_avg_sq"):
            dense = moments[name][k]
            rep.close(
                f"{tag} loaded {name} {k}", opt.state[p][k], spec.local_of(dense) if spec else dense, TOL
            )
        got_step = float(opt.state[p]["step"])
        rep.check(f"{tag} {name} step", got_step == SAVED, f"step {got_step}")
    for i in range(SAVED, STEPS):
        rep.close(f"{tag} loss step {i}", step(model, opt, i), losses[i], TOL)
    full = model.full_state_dict() if tp is not None else model.state_dict()
    rep.check(f"{tag} keys", list(full) == list(final), str(list(full)[:3]))
    for key, t in final.items():
        rep.close(f"{tag} final {key}", full[key], t, TOL)


def train_and_save(rep: Report, tag: str, path: Path, tp: Any, group: Any, want: Any) -> None:
    model = model_at(tp, 5)
    opt = opt_for(model)
    for i in range(SAVED):
        rep.close(f"{tag} loss step {i}", step(model, opt, i), want[0][i], TOL)
    state = pp.tp_optim_state(model, opt) if tp is None else model.optim_state(opt)
    pp.checkpoint.save({"model": model, "optim": state}, path, group)


def scenario(world: Any, rep: Report) -> None:
    root = Path(sys.argv[1])
    want = uninterrupted()
    pair = world.group.new_subgroup([0, 1]) if world.rank < 2 else None
    if pair is not None:
        train_and_save(rep, "tp2 save", root / "tp2", pair, pair, want)
    train_and_save(rep, "tp1 save", root / "tp1", None, world.group, want)
    world.group.barrier()
    resume(rep, "tp2 -> tp1", root / "tp2", None, world.group, want)
    resume(rep, "tp2 -> tp3", root / "tp2", world.group, world.group, want)
    resume(rep, "tp1 -> tp3", root / "tp1", world.group, world.group, want)
    if pair is not None:
        resume(rep, "tp1 -> tp2", root / "tp1", pair, pair, want)


if __name__ == "__main__":
    run_rank(scenario)
