"""A torch optimizer's state over a tensor-parallel model, saved with ``pp.checkpoint`` at one tp size and
loaded at another (``model.optim_state(opt)`` / ``pp.tp_optim_state``).

World 4. Every rank trains the plain transformers GPT-2 (float64, tied embedding, 12 heads; its fused
``c_attn`` and Conv1D columns are written as each tp rank's range of the dense array, its row splits in
place) with AdamW for ``STEPS`` steps on one process, the learning rate decayed after every step: the
uninterrupted run. Then:

- tp 2 (ranks 0, 1), tp 4 (all ranks) and tp 1 (the plain model) each train ``SAVED`` steps and save model
  and AdamW state; the column-split arrays' pieces in the manifest are one per tp rank, in its own file;
- tp 2 loads at tp 4 and tp 3 (ranks 0-2), tp 4 at tp 2 and tp 1 (the plain model), tp 1 at tp 2, each into
  a fresh AdamW built with other hyperparameters.

After each load: every loaded ``exp_avg`` / ``exp_avg_sq`` is this rank's piece of the uninterrupted run's
(resharded like its parameter), the step count and the hyperparameters (the decayed lr, betas, eps, weight
decay) are the saved ones, and the remaining steps' losses and the final parameters equal the uninterrupted
run's (float64, 1e-9).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank
from tp_torch import batch, build

import paramplane as pp

STEPS, SAVED, HEADS = 4, 2, 12  # 12 heads: split at tp 2, 3 and 4
TOL = 1e-9  # float64; tp sums in another order, and Adam divides by sqrt(v) (measured: ~1.5e-12)


def opt_for(model: Any, fresh: bool = False) -> Any:
    """The run's AdamW, or (``fresh``) one with other hyperparameters that a checkpoint must replace."""
    import torch

    if fresh:
        return torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.5, 0.6), eps=1e-3, weight_decay=0.0)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.1)


def step(model: Any, opt: Any, i: int) -> float:
    loss = model(**batch(i)).loss  # gathered logits: the model's own loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    for group in opt.param_groups:  # a schedule: a resumed run must continue from the saved lr
        group["lr"] *= 0.7
    return float(loss.item())


def hyperparams(opt: Any) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]


def uninterrupted() -> tuple[list[float], dict[str, Any], dict[str, Any], Any]:
    """Losses of every step, AdamW's dense state and hyperparameters after ``SAVED`` steps, the final
    parameters."""
    model = build("gpt2", seed=5, n_head=HEADS)
    opt = opt_for(model)
    losses, moments, hyper = [], {}, None
    for i in range(STEPS):
        losses.append(step(model, opt, i))
        if i == SAVED - 1:
            hyper = hyperparams(opt)
            for name, p in model.named_parameters():
                moments[name] = {k: v.clone() for k, v in opt.state[p].items()}
    return losses, moments, {k: v.clone() for k, v in model.state_dict().items()}, hyper


def model_at(tp: Any, seed: int) -> Any:
    """GPT-2 (seed 5: the uninterrupted run's start; another: the checkpoint must set everything), split over
    ``tp`` (None: the plain model)."""
    model = build("gpt2", seed=seed, n_head=HEADS)
    if tp is not None:
        pp.parallelize(model, tp, pp.tp_plan_for(model))
    return model


def resume(rep: Report, tag: str, path: Path, tp: Any, group: Any, want: Any) -> None:
    losses, moments, final, hyper = want
    model = model_at(tp, 9)
    opt = opt_for(model, fresh=True)
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
    rep.check(f"{tag} hyperparameters", hyperparams(opt) == hyper, str(hyperparams(opt)))
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
    if tp is not None and group.rank == 0:
        pieces_per_rank(rep, tag, path, tp.size)


def pieces_per_rank(rep: Report, tag: str, path: Path, size: int) -> None:
    """Column-split arrays (Conv1D columns, the fused q/k/v) and their moments: one equal range per tp rank,
    each written by that rank (no rank writes the whole array)."""
    arrays = pp.checkpoint.read_manifest(path)["arrays"]
    for name in ("transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_fc.weight"):
        for key in (f"model/{name}", f"optim/state.{name}.exp_avg", f"optim/state.{name}.exp_avg_sq"):
            numel = math.prod(arrays[key]["global_shape"])
            got = sorted((p["start"], p["stop"], p["file"]) for p in arrays[key]["pieces"])
            want = [(r * numel // size, (r + 1) * numel // size, f"rank-{r}.data") for r in range(size)]
            rep.check(f"{tag} pieces of {key}", got == want, str(got))


def scenario(world: Any, rep: Report) -> None:
    root = Path(sys.argv[1])
    want = uninterrupted()
    pair = world.group.new_subgroup([0, 1]) if world.rank < 2 else None
    trio = world.group.new_subgroup([0, 1, 2]) if world.rank < 3 else None
    if pair is not None:
        train_and_save(rep, "tp2 save", root / "tp2", pair, pair, want)
    train_and_save(rep, "tp4 save", root / "tp4", world.group, world.group, want)
    train_and_save(rep, "tp1 save", root / "tp1", None, world.group, want)
    world.group.barrier()
    resume(rep, "tp2 -> tp4", root / "tp2", world.group, world.group, want)
    resume(rep, "tp4 -> tp1", root / "tp4", None, world.group, want)
    if trio is not None:
        resume(rep, "tp2 -> tp3", root / "tp2", trio, trio, want)
    if pair is not None:
        resume(rep, "tp4 -> tp2", root / "tp4", pair, pair, want)
        resume(rep, "tp1 -> tp2", root / "tp1", pair, pair, want)


if __name__ == "__main__":
    run_rank(scenario)
