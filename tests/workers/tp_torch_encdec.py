"""Tensor parallel on encoder-decoders: transformers BART and T5 (``pp.tp_plan_for``), cross-attention included.

``bart`` or ``t5``, world 2. Every rank builds the same tiny model (float64, 4 heads, tied shared embedding /
head, no dropout) twice: dense, and split at tp 2 by ``pp.tp_plan_for``: the encoder's and the decoder's
self-attention, the decoder's cross-attention (BART's ``encoder_attn``, T5's ``EncDecAttention``: queries from
the decoder, keys and values from the encoder's output) split by heads (T5's relative position bias by its
head columns), the feed-forward column/row, the shared embedding and head over the vocabulary. Each
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
from _tp_dense import train_against_dense

import paramplane as pp

VOCAB, SEQ, HEADS, STEPS = 48, 10, 4, 3
TOL = 1e-9  # float64; tp sums in another order


def build(name: str, seed: int = 0) -> Any:
    import os
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    if name == "t5":
        t5 = T5Config(
            vocab_size=VOCAB,
            d_model=16,
            d_kv=4,
            d_ff=32,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=HEADS,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            dropout_rate=0.0,
            feed_forward_proj="gated-gelu",
            pad_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=0,
        )
        return T5ForConditionalGeneration(t5).double()
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

    tp, kind = world.group, sys.argv[1]
    dense, model = build(kind), build(kind)
    plan = pp.tp_plan_for(model)
    t5 = (
        "EncDecAttention.k",
        "EncDecAttention.o",
        "SelfAttention.q",
        "DenseReluDense.wi_0",
        "DenseReluDense.wo",
    )
    bart = ("encoder_attn.k_proj", "encoder_attn.out_proj", "self_attn.q_proj", "fc1", "fc2")
    for name in t5 if kind == "t5" else bart:
        rep.check(f"plan has {name}", any(k.endswith(name) for k in plan), str(sorted(plan)))
    pp.parallelize(model, tp, plan)
    if kind == "t5":
        cross = model.decoder.block[0].layer[1].EncDecAttention
        got = (cross.k.weight.shape, cross.o.weight.shape, cross.n_heads)
        bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.shape
        rep.check("relative position bias split by heads", tuple(bias) == (8, HEADS // 2), str(bias))
    else:
        cross = model.model.decoder.layers[0].encoder_attn
        got = (cross.k_proj.weight.shape, cross.out_proj.weight.shape, HEADS // 2)
    got_shape = tuple(got[0]), tuple(got[1]), got[2]
    rep.check("cross-attention heads split", got_shape == ((8, 16), (16, 8), 2), str(got_shape))
    # The keys' bias gets a zero gradient (softmax ignores what is added to every key alike): its float noise
    # (~1e-17) would set the sign of AdamW's first updates, so it is frozen in both models.
    for m in (dense, model):
        for pname, p in m.named_parameters():
            if pname.endswith("k_proj.bias"):
                p.requires_grad_(False)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (dense, model)]
    split = ("proj.weight", "fc1.weight", "fc2.weight", "shared.weight", "wi_0.weight", "wo.weight")

    def losses(step: int) -> tuple[Any, Any]:
        b = batch(step)
        return dense(**b).loss, model(**b).loss

    train_against_dense(
        rep,
        dense,
        model,
        opts,
        losses,
        lambda n: n.endswith(split) or n.endswith((".q.weight", ".k.weight", ".o.weight")),
        STEPS,
        TOL,
    )


if __name__ == "__main__":
    run_rank(scenario)
