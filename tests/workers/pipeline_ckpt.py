"""Pipeline stages loading their own part of a checkpoint (2 ranks), against one process.

GPT-2 (4 blocks, float64, tied embedding/head) trained two AdamW steps as a pp 2 pipeline cut at block 1 is saved
with ``pp.checkpoint`` (each stage its own parameters, under the whole model's names, and its AdamW state through
``pp.pipeline_optim_state``: the dense model's keys, the tied weight's under ``transformer.wte.weight``); one
process trains the same steps and saves the dense model and ``pp.tp_optim_state(model, opt)``. Then fresh models
(other weights) are cut again, each stage loads the checkpoint directly (``pp.checkpoint.load({"model": stage,
"optim": pp.pipeline_optim_state(stage, opt)}, ...)`` into a fresh AdamW: only its own keys): at pp 1 (the whole
model as one stage, ``pp.FSDP`` over dp 2), at pp 2 cut at block 3, and from the dense save at pp 2 cut at block
2. Each takes steps three and four, whose losses and parameters equal one process's (1e-9); what a stage does
not hold keeps the fresh model's values (it was not read).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank

import paramplane as pp

LAYERS, ROWS, MICROBATCHES, LR, RTOL, STEPS = 4, 8, 2, 1e-2, 1e-9, 4


def batch(step: int) -> dict[str, Any]:
    return tm.left_padded_batch(7 + step, ROWS)


def pipeline_step(mesh: pp.Mesh, pipe: Any, step: int) -> float:
    """One step of the pipeline on this replica's rows; the mean loss over the last stage's replicas."""
    dp = mesh.size("dp") if "dp" in mesh.names else 1
    d = mesh.coordinate("dp") if dp > 1 else 0
    b = {k: v[d * ROWS // dp : (d + 1) * ROWS // dp] for k, v in batch(step).items()}
    losses = pipe.step(
        b["input_ids"] if pipe.is_first else None,
        target=b["labels"] if pipe.is_last else None,
        attention_mask=b["attention_mask"],
    )
    total = np.array([np.mean(losses) if losses is not None else 0.0])
    if dp > 1:
        mesh.group(("pp", "dp")).all_reduce(total, "sum")
    else:
        mesh.group("pp").all_reduce(total, "sum")
    return float(total[0]) / dp


def adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def unbroken_run(world: Any, path: Path) -> tuple[list[float], dict[str, Any]]:
    """One process: ``STEPS`` AdamW steps of the whole model, the dense model and its optimizer saved at ``path``
    after two; returns each step's loss and the final state dict (numpy)."""
    ref = tm.build("gpt2", layers=LAYERS)
    ref_opt = adamw(ref.parameters())
    ref_losses = []
    for step in range(STEPS):
        b = batch(step)
        loss = pp.causal_lm_loss(
            ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"]
        )
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        ref_losses.append(float(loss))
        if step == 1:
            optim = pp.tp_optim_state(ref, ref_opt)
            pp.checkpoint.save({"model": ref, "optim": optim, "step": 2}, path, world.group)
    return ref_losses, {k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}


def scenario(world: Any, rep: Report, out: Path) -> None:
    ref_losses, ref_state = unbroken_run(world, out / "dense")

    # pp 2 cut at block 1: two steps, each stage saves its own parameters.
    mesh = pp.Mesh(world, pp=2)
    stage = pp.pipeline_split(tm.build("gpt2", layers=LAYERS), [1])[mesh.coordinate("pp")]
    pipe = pp.Pipeline(stage, mesh.group("pp"), "1f1b", MICROBATCHES, loss_fn=pp.causal_lm_loss)
    opt = adamw(stage.parameters())
    for step in range(2):
        rep.close(f"trained loss {step}", pipeline_step(mesh, pipe, step), ref_losses[step], RTOL)
        opt.step()
        opt.zero_grad(set_to_none=True)
    saved = {"model": stage, "optim": pipe.optim_state(opt), "step": 2}
    pp.checkpoint.save(saved, out / "pp2", world.group)
    keys = set(pp.pipeline_optim_state(stage, opt).sharded_state_dict())
    rep.check(
        "tied moment under the embedding's name", "state.transformer.wte.weight.exp_avg" in keys, str(keys)
    )
    rep.check("no key of the split", not any("lm_head" in k for k in keys), str(keys))

    cases = (
        ("pp2 -> pp1 fsdp dp2", "pp2", 1, []),
        ("pp2 -> pp2 at 3", "pp2", 2, [3]),
        ("dense -> pp2 at 2", "dense", 2, [2]),
    )
    for name, saved, p, cuts in cases:
        mesh = pp.Mesh(world, dp=world.world_size // p, pp=p)
        fresh = tm.build("gpt2", seed=1, layers=LAYERS)
        before = {k: v.detach().numpy().copy() for k, v in fresh.state_dict().items()}
        stage = pp.pipeline_split(fresh, cuts)[mesh.coordinate("pp")]
        mine = set(stage.state_dict())
        module = pp.FSDP(stage, mesh.group("dp")) if p == 1 else stage
        opt = adamw(module.parameters())
        optim = pp.pipeline_optim_state(module, opt)
        got = pp.checkpoint.load({"model": module, "optim": optim, "step": 0}, out / saved, world.group)
        rep.check(f"{name} step", got["step"] == 2, str(got["step"]))
        counts = {float(s["step"]) for s in opt.state.values()}
        rep.check(f"{name} AdamW step count", counts == {2.0}, str(counts))
        # the whole model: what the stage does not hold was not read (keep_vars: an FSDP-sharded stage refuses
        # to hand out its placeholders as values)
        held = stage.state_dict(keep_vars=True)
        for k, v in fresh.state_dict(keep_vars=True).items():
            if k not in mine and not any(v.data_ptr() == held[m].data_ptr() for m in mine):
                rep.check(f"{name} untouched {k}", np.array_equal(v.detach().numpy(), before[k]), "changed")
        pipe = pp.Pipeline(module, mesh.group("pp"), "1f1b", MICROBATCHES, loss_fn=pp.causal_lm_loss)
        for step in range(2, STEPS):
            rep.close(f"{name} loss {step}", pipeline_step(mesh, pipe, step), ref_losses[step], RTOL)
            opt.step()
            opt.zero_grad(set_to_none=True)
        state = module.state_dict()
        for k in sorted(mine):
            rep.close(f"{name} final {k}", state[k].detach().numpy(), ref_state[k], RTOL)


if __name__ == "__main__":
    run_rank(lambda world, rep: scenario(world, rep, Path(sys.argv[1])))
