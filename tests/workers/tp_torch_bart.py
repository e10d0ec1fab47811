"""Tensor parallel on an encoder-decoder: transformers BART (``pp.tp_plan_for``), cross-attention included.

World 2. Every rank builds the same tiny BART (float64, 4 heads, tied shared embedding / head, no dropout)
twice: dense, and split at tp 2 by ``pp.tp_plan_for``: the encoder's and the decoder's self-attention, the
decoder's cross-attention (``encoder_attn``: queries from the decoder, keys and values from the encoder's
output) split by heads, ``fc1``/``fc2`` column/row, the shared embedding and head over the vocabulary. Each
trains ``STEPS`` AdamW steps with the model's own loss (``labels=``) on the same batches; checked against the
dense model: every step's loss, the first step's gradients (each shard against its piece of the dense
gradient), the final parameters (``full_state_dict``), and that the heads really are split.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp

VOCAB, SEQ, HEADS, STEPS = 48, 10, 4, 3
TOL = 1e-9  # float64; tp sums in another order


def build(seed: int = 0) -> Any:
    import os
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    cfg = BartConfig(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=SEQ,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        scale_embedding=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    return BartForConditionalGeneration(cfg).double()


def batch(step: int) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(step)
    ids = torch.from_numpy(rng.integers(3, VOCAB, (3, SEQ)))
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[0, -3:] = 0
    labels = torch.from_numpy(rng.integers(3, VOCAB, (3, SEQ - 2)))
    labels[1, -2:] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def scenario(world: Any, rep: Report) -> None:
    import torch

    tp = world.group
    dense, model = build(), build()
    plan = pp.tp_plan_for(model)
    for name in ("encoder_attn.k_proj", "encoder_attn.out_proj", "self_attn.q_proj", "fc1", "fc2"):
        rep.check(f"plan has {name}", any(k.endswith(name) for k in plan), str(sorted(plan)))
    pp.parallelize(model, tp, plan)
    cross = model.model.decoder.layers[0].encoder_attn
    got_shape = tuple(cross.k_proj.weight.shape), tuple(cross.out_proj.weight.shape)
    rep.check("cross-attention heads split", got_shape == ((8, 16), (16, 8)), str(got_shape))
    # The keys' bias gets a zero gradient (softmax ignores what is added to every key alike): its float noise
    # (~1e-17) would set the sign of AdamW's first updates, so it is frozen in both models.
    for m in (dense, model):
        for pname, p in m.named_parameters():
            if pname.endswith("k_proj.bias"):
                p.requires_grad_(False)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (dense, model)]
    for step in range(STEPS):
        b = batch(step)
        want, got = dense(**b).loss, model(**b).loss
        want.backward()
        got.backward()
        rep.close(f"loss step {step}", got.item(), want.item(), TOL)
        if step == 0:
            dense_params = dict(dense.named_parameters())
            for pname, p in model.named_parameters():
                g = dense_params[pname].grad
                if g is None:
                    rep.check(f"{pname} frozen alike", p.grad is None, pname)
                    continue
                spec = getattr(p, "tp_shard", None)
                if pname.endswith(("proj.weight", "fc1.weight", "fc2.weight", "shared.weight")):
                    rep.check(f"{pname} split", spec is not None, pname)
                rep.close(f"grad {pname}", p.grad, spec.local_of(g) if spec else g, TOL)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    full, plain = model.full_state_dict(), dense.state_dict()
    rep.check("full_state_dict keys", list(full) == list(plain), f"{list(full)[:3]}")
    for key, t in plain.items():
        rep.close(f"final {key}", full[key], t, TOL)


if __name__ == "__main__":
    run_rank(scenario)
