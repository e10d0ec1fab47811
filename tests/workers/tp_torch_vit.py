"""Tensor parallel on timm's Vision Transformer (``pp.tp_plan_for``), world 2.

Every rank builds the same tiny ViT (float64, 4 heads, width 16, 2 blocks, 16 px images in 4 px patches, no
dropout) twice: dense, and split at tp 2 by ``pp.tp_plan_for``: each block's fused ``qkv`` by heads (3 blocks
of q, k and v), ``proj`` row-wise, the MLP column/row; the patch embedding, class token, position embedding and
head replicated. Both train ``STEPS`` AdamW steps with the usual ``cross_entropy`` on the same batches;
checked against the dense model: every step's loss, the first step's gradients (each shard against its piece
of the dense gradient), the final parameters (``full_state_dict``), and that the heads really are split. Then
the refusals: heads that do not divide by tp, and attention whose norm spans every head (``scale_attn_norm``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank
from _tp_dense import train_against_dense

import paramplane as pp

HEADS, STEPS = 4, 3
TOL = 1e-9  # float64; tp sums in another order


def build(heads: int = HEADS, seed: int = 0, **kw: Any) -> Any:
    import torch

    torch.manual_seed(seed)
    model = tm.timm_module().create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=4,
        embed_dim=4 * heads,
        depth=2,
        num_heads=heads,
        num_classes=5,
        **kw,
    )
    return model.double()


def batch(step: int) -> tuple[Any, Any]:
    import torch

    rng = np.random.default_rng(step)
    return torch.from_numpy(rng.standard_normal((3, 3, 16, 16))), torch.from_numpy(rng.integers(0, 5, 3))


def scenario(world: Any, rep: Report) -> None:
    import torch

    tp = world.group
    dense, model = build(), build()
    plan = pp.tp_plan_for(model)
    for name in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"):
        rep.check(f"plan has {name}", any(k.endswith(name) for k in plan), str(sorted(plan)))
    pp.parallelize(model, tp, plan)
    attn = model.blocks[0].attn
    got = (tuple(attn.qkv.weight.shape), tuple(attn.proj.weight.shape), attn.num_heads, attn.attn_dim)
    rep.check("heads split", got == ((24, 16), (16, 8), HEADS // 2, 8), str(got))
    # The keys' bias gets a zero gradient (softmax ignores what is added to every key alike): its float noise
    # would set the sign of AdamW's first updates, so the fused qkv biases are left out of both optimizers
    # (their first gradients are still compared).
    opts = [
        torch.optim.AdamW(
            [p for n, p in m.named_parameters() if not n.endswith("qkv.bias")], lr=1e-2, weight_decay=0.1
        )
        for m in (dense, model)
    ]

    def losses(step: int) -> tuple[Any, Any]:
        images, labels = batch(step)
        cross_entropy = torch.nn.functional.cross_entropy
        return cross_entropy(dense(images), labels), cross_entropy(model(images), labels)

    split = ("attn.qkv.weight", "attn.proj.weight", "fc1.weight", "fc2.weight")
    train_against_dense(rep, dense, model, opts, losses, lambda n: n.endswith(split), STEPS, TOL)

    for label, kw, message in (
        ("3 heads over tp 2", {"heads": 3}, "3 attention heads"),
        ("a norm over every head", {"scale_attn_norm": True}, "spans every head"),
    ):
        bad = build(**kw)
        rep.raises(
            f"{label} refused", ValueError, lambda m=bad: pp.parallelize(m, tp, pp.tp_plan_for(m)), message
        )


if __name__ == "__main__":
    run_rank(scenario)
