"""Tensor parallel for torch modules (``pp.parallelize``) on transformers GPT-2 and Llama at tiny configs.

``train`` (world 3): at tp 2 (ranks 0 and 1) and tp 3 (all), each model trains a few AdamW steps with its logits
split over the vocabulary and ``pp.vocab_parallel_cross_entropy``; every rank also trains the dense model on the
same batch in float64 and checks: every step's loss, the first step's gradients (each shard against the same
piece of the dense gradient), the final parameters (``full_state_dict``) and the number of all-reduces of a
step (one forward and one backward per column/row pair, Llama's separate q/k/v included); both also under
Megatron sequence parallel (``tp_plan_for(..., sequence_parallel=True)``), the same checks. Then the
gathered-logits plan: logits and the model's own loss equal the dense model's; and a plain ``nn.Sequential``
with ``gather_output`` / ``input_is_parallel=False``.

``misc DIR`` (world 3): heads, key/value heads and vocabulary that do not divide by tp raise ValueErrors naming
both numbers, before anything changes; the vocabulary-parallel cross-entropy equals torch's on the full logits
(loss and gradient, every reduction, ignored targets); a model trained at tp 2 is saved with ``pp.checkpoint``
and loaded at tp 3 and into the plain model.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp

VOCAB, SEQ, STEPS = 48, 12, 3
RTOL = 1e-9


def build(name: str, seed: int = 0, **over: Any) -> Any:
    """GPT-2 or Llama (GQA) whose heads, widths and vocabulary divide by 2 and 3, float64, tied embeddings."""
    import os
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.manual_seed(seed)
    if name == "gpt2-cross":  # a decoder attending to an encoder's states in every block
        name, over = "gpt2", {"add_cross_attention": True, **over}
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        kw = dict(
            n_layer=2, n_embd=24, n_head=6, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
        )
        cfg = GPT2Config(**{**kw, **over})
        cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
        return GPT2LMHeadModel(cfg).double()
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(
        num_hidden_layers=2,
        hidden_size=24,
        intermediate_size=48,
        num_attention_heads=12,
        num_key_value_heads=6,
        head_dim=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(LlamaConfig(**{**kw, **over})).double()


def batch(step: int) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(step)
    ids = torch.from_numpy(rng.integers(0, VOCAB, (3, SEQ)))
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[0, -2:] = 0
    labels = ids.clone()
    labels[0, -2:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def encoder_states(step: int) -> dict[str, Any]:
    """What a cross-attention model reads besides the batch: an encoder's states (5 positions, the last of
    the first row masked), requiring a gradient as an encoder's output would."""
    import torch

    rng = np.random.default_rng(100 + step)
    states = torch.from_numpy(rng.standard_normal((3, 5, 24))).requires_grad_()
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[0, -1] = 0
    return {"encoder_hidden_states": states, "encoder_attention_mask": mask}


def shifted(logits: Any, labels: Any) -> tuple[Any, Any]:
    """Causal LM: position t predicts token t + 1."""
    return logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)


def _counting(group: Any) -> list[int]:
    calls = [0]
    inner = group.all_reduce

    def all_reduce(x: Any, op: str = "sum", **kw: Any) -> Any:
        calls[0] += 1
        return inner(x, op, **kw)

    group.all_reduce = all_reduce
    return calls


def train_one(rep: Report, name: str, tp: Any, sequence: bool = False) -> None:
    import torch
    import torch.nn.functional as F

    tag = f"{name} tp{tp.size}" + (" sp" if sequence else "")
    dense, model = build(name), build(name)
    pp.parallelize(model, tp, pp.tp_plan_for(model, loss_parallel=True, sequence_parallel=sequence))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (dense, model)]
    calls = _counting(tp)
    num_layers = len(model.model.layers if name == "llama" else model.transformer.h)
    cross = name == "gpt2-cross"
    if cross:
        attn = model.transformer.h[0].crossattention
        heads = (
            attn.num_heads,
            attn.split_size,
            tuple(attn.q_attn.weight.shape),
            tuple(attn.c_attn.weight.shape),
        )
        want_heads = (6 // tp.size, 24 // tp.size, (24, 24 // tp.size), (24, 48 // tp.size))
        rep.check(f"{tag} cross heads split", heads == want_heads, f"{heads} != {want_heads}")
    for step in range(STEPS):
        b = batch(step)
        kw = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
        enc = encoder_states(step) if cross else {}
        mine = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in enc.items()}
        want = F.cross_entropy(*shifted(dense(**kw, **enc).logits, b["labels"]))
        calls[0] = 0
        logits, target = shifted(model(**kw, **mine).logits, b["labels"])
        rep.check(f"{tag} logits split", logits.shape[-1] == VOCAB // tp.size, str(logits.shape))
        got = pp.vocab_parallel_cross_entropy(logits, target, tp)
        want.backward()
        got.backward()
        # forward: a row all-reduce per attention and MLP, the embedding's, the loss's two; backward: the
        # column input's per attention and MLP and the head's
        # cross-attention adds per layer its row all-reduce and the f of its queries and of the encoder states
        if not sequence:
            want_calls = (7 if cross else 4) * num_layers + 4
            rep.check(f"{tag} all-reduces per step", calls[0] == want_calls, f"{calls[0]} != {want_calls}")
        rep.close(f"{tag} loss step {step}", got.item(), want.item(), RTOL)
        if cross:
            states = "encoder_hidden_states"
            rep.close(f"{tag} encoder states grad {step}", mine[states].grad, enc[states].grad, RTOL)
        if step == 0:
            dense_params = dict(dense.named_parameters())
            for pname, p in model.named_parameters():
                g = dense_params[pname].grad
                spec = getattr(p, "tp_shard", None)
                rep.close(f"{tag} grad {pname}", p.grad, spec.local_of(g) if spec else g, RTOL)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    full, plain = model.full_state_dict(), dense.state_dict()
    rep.check(f"{tag} full_state_dict keys", list(full) == list(plain), f"{list(full)[:3]}")
    for key, t in plain.items():
        rep.close(f"{tag} final {key}", full[key], t, RTOL)


def gathered(rep: Report, name: str, tp: Any) -> None:
    """The default plan gathers the logits: the model's own loss (``labels=``) works unchanged."""
    dense, model = build(name), build(name)
    pp.parallelize(model, tp, pp.tp_plan_for(model))
    b = batch(7)
    want, got = dense(**b), model(**b)
    rep.close(f"{name} tp{tp.size} gathered logits", got.logits.detach(), want.logits.detach(), RTOL)
    rep.close(f"{name} tp{tp.size} model's own loss", got.loss.item(), want.loss.item(), 1e-6)


def sequential(rep: Report, tp: Any) -> None:
    """colwise(gather_output) -> rowwise(input_is_parallel=False) on plain Linear layers."""
    import torch

    def mlp() -> Any:
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 6)).double()

    dense, model = mlp(), mlp()
    plan = {"0": pp.ColwiseParallel(gather_output=True), "2": pp.RowwiseParallel(input_is_parallel=False)}
    pp.parallelize(model, tp, plan)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((5, 6))).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y, y2 = dense(x), model(x2)
    rep.close(f"seq tp{tp.size} output", y2.detach(), y.detach(), RTOL)
    (y**2).sum().backward()
    (y2**2).sum().backward()
    rep.close(f"seq tp{tp.size} input grad", x2.grad, x.grad, RTOL)
    for (pname, p), q in zip(model.named_parameters(), dense.parameters()):
        spec = getattr(p, "tp_shard", None)
        rep.close(f"seq tp{tp.size} grad {pname}", p.grad, spec.local_of(q.grad) if spec else q.grad, RTOL)


def train(world: Any, rep: Report) -> None:
    pair = world.group.new_subgroup([0, 1]) if world.rank < 2 else None
    for tp in [pair, world.group]:
        if tp is None:
            continue
        for name in ("gpt2", "llama"):
            train_one(rep, name, tp)
            train_one(rep, name, tp, sequence=True)
            gathered(rep, name, tp)
        train_one(rep, "gpt2-cross", tp)
        train_one(rep, "gpt2-cross", tp, sequence=True)
        sequential(rep, tp)


def errors(rep: Report, tp: Any) -> None:
    model = build("gpt2", n_head=2, n_embd=24)
    before = [p.clone() for p in model.parameters()]
    rep.raises(
        "heads",
        ValueError,
        lambda: pp.parallelize(model, tp, pp.tp_plan_for(model)),
        "2 attention heads",
        "tp=3",
    )
    rep.check("nothing changed", all(a.equal(b) for a, b in zip(before, model.parameters())))
    rep.check("nothing changed 2", model.transformer.h[0].attn.num_heads == 2)
    llama = build("llama", num_attention_heads=6, num_key_value_heads=2)
    rep.raises(
        "kv heads",
        ValueError,
        lambda: pp.parallelize(llama, tp, pp.tp_plan_for(llama)),
        "2 key/value heads",
        "tp=3",
    )
    odd = build("gpt2", vocab_size=50)
    rep.raises("vocab", ValueError, lambda: pp.parallelize(odd, tp, pp.tp_plan_for(odd)), "50 rows", "tp=3")
    wrong = build("gpt2")
    rep.raises(
        "fused qkv",
        ValueError,
        lambda: pp.parallelize(wrong, tp, {"*attn.c_attn": "colwise", "*attn.c_proj": "rowwise"}),
        "parts=3",
    )
    cross = build("gpt2-cross")
    rep.raises(
        "cross kv",
        ValueError,
        lambda: pp.parallelize(cross, tp, {"*crossattention.c_attn": pp.ColwiseParallel(parts=3)}),
        "parts=2",
    )
    rep.raises(
        "cross q",
        ValueError,
        lambda: pp.parallelize(cross, tp, {"*crossattention.c_attn": pp.ColwiseParallel(parts=2)}),
        "q_attn",
    )
    odd_cross = build("gpt2-cross", n_head=4)
    plan = pp.tp_plan_for(odd_cross)
    rep.raises(
        "cross heads", ValueError, lambda: pp.parallelize(odd_cross, tp, plan), "4 attention heads", "tp=3"
    )
    rep.raises("tied", ValueError, lambda: pp.parallelize(wrong, tp, {"transformer.wte": "vocab"}), "tied")
    rep.raises(
        "unmatched", ValueError, lambda: pp.parallelize(wrong, tp, {"*nothing": "colwise"}), "*nothing"
    )
    rep.raises("style", ValueError, lambda: pp.parallelize(wrong, tp, {"lm_head": "diagonal"}), "diagonal")


def cross_entropy(rep: Report, tp: Any) -> None:
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(11)
    full = torch.from_numpy(rng.standard_normal((2, 5, 12)) * 4)
    target = torch.from_numpy(rng.integers(0, 12, (2, 5)))
    target[1, 2] = -100
    k = 12 // tp.size
    for reduction in ("mean", "sum", "none"):
        a = full.clone().requires_grad_()
        shard = full[..., tp.rank * k : (tp.rank + 1) * k].clone().requires_grad_()
        want = F.cross_entropy(a.reshape(-1, 12), target.reshape(-1), reduction=reduction)
        got = pp.vocab_parallel_cross_entropy(shard, target, tp, reduction=reduction)
        rep.close(f"ce tp{tp.size} {reduction}", got.detach().reshape(-1), want.detach().reshape(-1), 1e-12)
        weights = torch.arange(want.numel(), dtype=want.dtype).reshape(want.shape) + 1
        (want * weights).sum().backward()
        (got.reshape(want.shape) * weights).sum().backward()
        rep.close(
            f"ce tp{tp.size} {reduction} grad",
            shard.grad,
            a.grad[..., tp.rank * k : (tp.rank + 1) * k],
            1e-12,
        )
    rep.raises(
        "ce shape", ValueError, lambda: pp.vocab_parallel_cross_entropy(full, target[0], tp), "target shape"
    )


def checkpoint(rep: Report, world: Any, root: Path) -> None:
    import torch

    pair = world.group.new_subgroup([0, 1]) if world.rank < 2 else None
    path = root / "tp2"
    if pair is not None:
        model = build("gpt2", seed=1)
        pp.parallelize(model, pair, pp.tp_plan_for(model))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(**batch(0)).loss.backward()
        opt.step()
        saved = {k: v.clone() for k, v in model.full_state_dict().items()}
        pp.checkpoint.save({"model": model}, path, pair)
    world.group.barrier()
    at3 = build("gpt2", seed=2)
    pp.parallelize(at3, world.group, pp.tp_plan_for(at3))
    pp.checkpoint.load({"model": at3}, path, world.group)
    plain = build("gpt2", seed=3)
    pp.checkpoint.load({"model": plain}, path, world.group)
    full = at3.full_state_dict()
    ref = {k: v.detach() for k, v in plain.state_dict().items()}
    if pair is not None:
        for k, v in saved.items():
            rep.check(f"plain loaded {k}", bool(torch.equal(ref[k], v)))
    # rank 2 did not save: it checks through the plain model, which ranks 0 and 1 checked against the save
    for k, v in ref.items():
        rep.check(f"tp3 loaded {k}", bool(torch.equal(full[k], v)))
    b = batch(1)
    rep.close("tp3 loaded model computes", at3(**b).logits.detach(), plain(**b).logits.detach(), 1e-12)


def misc(world: Any, rep: Report) -> None:
    errors(rep, world.group)
    pair = world.group.new_subgroup([0, 1]) if world.rank < 2 else None
    for tp in (pair, world.group):
        if tp is not None:
            cross_entropy(rep, tp)
    checkpoint(rep, world, Path(sys.argv[2]))


if __name__ == "__main__":
    run_rank({"train": train, "misc": misc}[sys.argv[1]])
