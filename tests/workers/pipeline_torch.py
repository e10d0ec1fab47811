"""Pipelines of torch stage modules (``pp.pipeline_split`` of transformers GPT-2 / Llama and the project's
torch GPT) against one process on the whole batch.

Usage: ``pipeline_torch.py`` (world 2): every schedule, three AdamW steps each, per-step losses and gradients
and final parameters equal one process; the tied embedding equal on both stages; the attention mask reaches
every stage; then stage placement and boundary errors.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, digest, run_rank

import paramplane as pp

ROOT = Path(__file__).resolve().parents[2]
STEPS, MICROBATCHES, PER_MB = 3, 4, 2
# Llama's RMSNorm, rotary embedding and eager softmax compute in float32 whatever the model's dtype: a
# microbatch rounds differently from the whole batch there (as in the DDP drop-in tests).
RTOL = {"gpt2": 1e-9, "llama": 1e-5, "mistral": 1e-5, "qwen2": 1e-5, "tinygpt": 1e-9}


def tiny_gpt(layers: int) -> Any:
    """The project's own torch GPT (``examples/train_gpt.py``), small and in float64."""
    import torch

    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "examples" / "train_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.TinyGPT(vocab=tm.VOCAB, seq=tm.SEQ, dim=16, layers=layers, heads=2).double()


def build(name: str, layers: int) -> Any:
    return tiny_gpt(layers) if name == "tinygpt" else tm.build(name, layers=layers)


def batch(step: int) -> dict[str, Any]:
    """The global batch of ``step``: left padding in the first row of every microbatch (so the mask changes
    every later position's attention, and every microbatch has as many counted tokens)."""
    return tm.left_padded_batch(step, MICROBATCHES * PER_MB, PER_MB)


def reference_logits(model: Any, name: str, ids: Any, mask: Any) -> Any:
    if name == "tinygpt":
        return model(ids)
    return model(input_ids=ids, attention_mask=mask).logits


def equivalence(world: Any, rep: Report, schedule: str, name: str) -> None:
    import torch

    g = world.group
    p = g.size
    v = 2 if schedule == "interleaved_1f1b" else 1
    num_stages = p * v
    layers = 2 * num_stages
    model = build(name, layers)
    stages = pp.pipeline_split(model, [2 * s for s in range(1, num_stages)])
    mine = stages[g.rank :: p]
    pipe = pp.Pipeline(mine if v > 1 else mine[0], g, schedule, MICROBATCHES, loss_fn=pp.causal_lm_loss)
    params = [q for s in mine for q in s.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    ref = build(name, layers)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    rtol = RTOL[name]
    for step in range(STEPS):
        b = batch(step)
        losses = pipe.step(
            b["input_ids"] if pipe.is_first else None,
            target=b["labels"] if pipe.is_last else None,
            attention_mask=b["attention_mask"],
        )
        logits = reference_logits(ref, name, b["input_ids"], b["attention_mask"])
        want = pp.causal_lm_loss(logits, b["labels"])
        want.backward()
        if name != "tinygpt" and step == 0:  # the mask matters for this batch: a stage without it differs
            unmasked = pp.causal_lm_loss(reference_logits(ref, name, b["input_ids"], None), b["labels"])
            rep.check(f"{name} mask matters", abs(float(unmasked) - float(want)) > 1e-6)
        if pipe.is_last:
            assert losses is not None and len(losses) == MICROBATCHES
            rep.close(
                f"{name} {schedule} loss {step}", np.array(np.mean(losses)), np.array(float(want)), rtol
            )
        mine_grads = {n: q.grad for s in mine for n, q in s.named_parameters()}
        ref_grads = dict(ref.named_parameters(remove_duplicate=False))
        for n, grad in sorted(mine_grads.items()):
            assert grad is not None, n
            want_grad = ref_grads[n].grad
            rep.close(f"{name} {schedule} grad {n} {step}", grad.numpy(), want_grad.numpy(), rtol * 10)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    ref_state = ref.state_dict()
    for s in mine:
        for n, t in s.state_dict().items():
            rep.close(f"{name} {schedule} final {n}", t.numpy(), ref_state[n].numpy(), rtol * 10)
    tied = [
        t
        for s in mine
        for key, (n, _) in s._paramplane_stage.tied.items()
        for t in [dict(s.named_parameters())[n]]
    ]
    rep.values.setdefault("tied", {})[f"{name} {schedule}"] = [digest(t.detach().numpy()) for t in tied]


# Every schedule on GPT-2 and the project's GPT; Llama (grouped-query attention, rotary embedding) on the
# schedule with the most stages, and the models laid out as Llama with sliding-window attention shorter than the
# sequence: Mistral (every layer) and Qwen2 (the first layer full, the rest sliding: per-layer masks).
RUNS = [(s, n) for s in ("gpipe", "1f1b", "interleaved_1f1b") for n in ("gpt2", "tinygpt")]
RUNS += [("interleaved_1f1b", "llama"), ("1f1b", "mistral"), ("interleaved_1f1b", "qwen2")]


def scenario(world: Any, rep: Report) -> None:
    for schedule, name in RUNS:
        equivalence(world, rep, schedule, name)
    errors(world, rep)


def errors(world: Any, rep: Report) -> None:
    g = world.group
    model = build("gpt2", 4)
    stages = pp.pipeline_split(model, [1, 2, 3])
    rep.raises(
        "a stage on the wrong rank",
        ValueError,
        lambda: pp.Pipeline(stages[(g.rank + 1) % g.size], g, "gpipe", 2, loss_fn=pp.causal_lm_loss),
        "pipeline_split",
    )
    sharded = pp.FSDP(build("gpt2", 2), g)
    rep.raises(
        "an FSDP stage over the pipeline's group",
        ValueError,
        lambda: pp.Pipeline(sharded, g, "gpipe", 2, loss_fn=pp.causal_lm_loss),
        "pipeline's own group",
    )
    rep.raises("boundaries out of order", ValueError, lambda: pp.pipeline_split(model, [2, 1]), "increase")
    rep.raises("a model of no known layout", ValueError, lambda: pp.pipeline_split(tm.build("resnet"), [1]),
               "pipeline_split knows", "Qwen2ForCausalLM")  # fmt: skip
    rep.raises("boundary past the blocks", ValueError, lambda: pp.pipeline_split(model, [4]), "increase")


def main() -> None:
    run_rank(scenario)


if __name__ == "__main__":
    main()
