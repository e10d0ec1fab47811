"""``pp.parallelize`` against torch's own ``parallelize_module`` (DTensor over a gloo CPU process group).

World 2 (tp 2): every rank builds the same transformers Llama three times from seed 0 in float64 (untied
embedding and head: torch's plan splits each module's parameter on its own, which would untie them) and
splits one with ``pp.parallelize(model, tp, pp.tp_plan_for(model))`` and one with ``parallelize_module`` and
torchtitan's Llama plan (vocabulary-parallel embedding, column q/k/v/gate/up, row o/down, column head). Both
train 2 AdamW steps on the same batches; each checks every step's loss, the first step's gradients and the
final parameters, gathered dense (``TPShard.dense_of`` / ``DTensor.full_tensor``), against torch's and
against the dense model trained on one process. Twice: with the logits gathered (the model's own loss) and
with them left split over the vocabulary (``pp.vocab_parallel_cross_entropy`` against torch's
``loss_parallel()`` cross-entropy on a ``Shard(-1)`` DTensor); and under sequence parallel
(``tp_plan_for(..., sequence_parallel=True)`` against torchtitan's ``SequenceParallel`` norms and
``PrepareModuleInput`` layouts, the residual stream a ``Shard(1)`` DTensor), gathered logits.

GPT-2 is not compared: torch's ``ColwiseParallel`` / ``RowwiseParallel`` apply to ``nn.Linear`` and
``nn.Embedding`` only, and GPT-2's projections are transformers' ``Conv1D`` (the worker checks that torch
refuses it, so the day it does not, this comparison should grow).
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank
from tp_torch import batch, build, shifted

import paramplane as pp

TOL = 1e-12  # float64 (measured: under 1e-15); the two sum the ranks' parts in different orders
STEPS = 2


def torch_plan(loss_parallel: bool, sequence: bool) -> dict[str, Any]:
    """torchtitan's Llama plan on transformers' module names; ``sequence``: its sequence-parallel form (the
    region starts at the first layer's input here, as in ``pp.tp_plan_for``, because transformers' Llama builds
    its causal mask from the embedding's output)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    col = ColwiseParallel()
    row = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sequence else RowwiseParallel()
    layer = "model.layers.*."
    if loss_parallel:
        head = ColwiseParallel(use_local_output=False)
    else:
        head = ColwiseParallel(
            input_layouts=Shard(1) if sequence else Replicate(), output_layouts=Replicate()
        )
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        **{f"{layer}self_attn.{p}_proj": col for p in "qkv"},
        f"{layer}self_attn.o_proj": row,
        f"{layer}mlp.gate_proj": col,
        f"{layer}mlp.up_proj": col,
        f"{layer}mlp.down_proj": row,
        "lm_head": head,
    }
    if sequence:
        seq, whole = Shard(1), Replicate()
        plan |= {
            "model.layers.0": PrepareModuleInput(
                input_layouts=(whole,), desired_input_layouts=(seq,), use_local_output=False
            ),
            f"{layer}input_layernorm": SequenceParallel(),
            f"{layer}post_attention_layernorm": SequenceParallel(),
            f"{layer}self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": seq},
                desired_input_kwarg_layouts={"hidden_states": whole},
            ),
            f"{layer}mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
            "model.norm": SequenceParallel(),
        }
    return plan


def loss_of(kind: str, model: Any, step: int, tp: Any, loss_parallel: bool) -> float:
    """One forward and backward on batch ``step``; the loss."""
    import contextlib

    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    b = batch(step)
    if not loss_parallel:
        loss = model(**b).loss  # the model's own loss on gathered logits
        loss.backward()
        return float(loss.item())
    kw = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    logits, target = shifted(model(**kw).logits, b["labels"])
    if kind == "pp":
        loss = pp.vocab_parallel_cross_entropy(logits, target, tp)
        loss.backward()
        return float(loss.item())
    # torch's loss-parallel cross-entropy runs (forward and backward) inside its context
    with torch_loss_parallel() if kind == "torch" else contextlib.nullcontext():
        loss = F.cross_entropy(logits, target)
        loss.backward()
    return float(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())


def dense_grads(model: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        spec = getattr(p, "tp_shard", None)
        out[name] = g.full_tensor() if isinstance(g, DTensor) else spec.dense_of(g) if spec else g.detach()
    return out


def compare(rep: Report, tp: Any, mesh: Any, loss_parallel: bool, sequence: bool = False) -> None:
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    tag = ("loss-parallel" if loss_parallel else "gathered") + (" sequence-parallel" if sequence else "")
    models = {k: build("llama", tie_word_embeddings=False) for k in ("dense", "pp", "torch")}
    plan = pp.tp_plan_for(models["pp"], loss_parallel=loss_parallel, sequence_parallel=sequence)
    pp.parallelize(models["pp"], tp, plan)
    parallelize_module(models["torch"], mesh, torch_plan(loss_parallel, sequence))
    rep.check(f"{tag} torch split", isinstance(models["torch"].lm_head.weight, DTensor))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for k, m in models.items()}
    for step in range(STEPS):
        losses = {k: loss_of(k, m, step, tp, loss_parallel) for k, m in models.items()}
        rep.close(f"{tag} step {step} loss pp = torch", losses["pp"], losses["torch"], TOL)
        rep.close(f"{tag} step {step} loss torch = dense", losses["torch"], losses["dense"], TOL)
        if step == 0:
            grads = {k: dense_grads(m) for k, m in models.items()}
            rep.check(
                f"{tag} same parameters", list(grads["pp"]) == list(grads["torch"]), str(list(grads["pp"]))
            )
            for name, g in grads["torch"].items():
                rep.close(f"{tag} grad {name} pp = torch", grads["pp"][name], g, TOL)
                rep.close(f"{tag} grad {name} torch = dense", g, grads["dense"][name], TOL)
        for opt in opts.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
    mine = models["pp"].full_state_dict()
    theirs_state = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in models["torch"].state_dict().items()
    }
    dense = models["dense"].state_dict()
    rep.check(f"{tag} state keys", list(mine) == list(theirs_state) == list(dense), str(list(mine)[:3]))
    for key, t in theirs_state.items():
        rep.close(f"{tag} final {key} pp = torch", mine[key], t, TOL)
        rep.close(f"{tag} final {key} torch = dense", t, dense[key], TOL)


def torch_refuses_conv1d(rep: Report, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    gpt2 = build("gpt2")
    try:
        parallelize_module(gpt2, mesh, {"transformer.h.*.attn.c_attn": ColwiseParallel()})
    except (NotImplementedError, ValueError, RuntimeError, TypeError):
        rep.check("torch refuses GPT-2's Conv1D", True)
    else:
        rep.check("torch refuses GPT-2's Conv1D", False, "it splits Conv1D now: compare GPT-2 too")


def scenario(world: Any, rep: Report) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    store = Path(os.environ["PARAMPLANE_TEST_OUT"]) / "torch-store"
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=world.rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        mesh = init_device_mesh("cpu", (2,))
        tp = pp.Mesh(world, tp=2).group("tp")
        for loss_parallel in (False, True):
            compare(rep, tp, mesh, loss_parallel)
        compare(rep, tp, mesh, False, sequence=True)
        torch_refuses_conv1d(rep, mesh)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(scenario)
