"""Train a small GPT with FSDP full_shard and a torch loop: AdamW, clipping, bfloat16 autocast, checkpoints.

    paramplane launch --standalone -n 2 examples/train_gpt.py --steps 40 --checkpoint-dir gpt_ckpt
    paramplane launch --standalone -n 2 examples/train_gpt.py --steps 80 --checkpoint-dir gpt_ckpt --resume
    paramplane demo --torch                   # the same, on 2 ranks, from the installed package

The model is ``transformers``' GPT-2 (a tiny config built from scratch, no download) when transformers is
installed, else the small GPT defined below; both tie the token embedding to the output head. The loop is
the one a torch user writes: ``out = fsdp(input_ids=..., labels=...)``, ``loss.backward()``,
``fsdp.clip_grad_norm_(1.0)`` (the global norm over every rank's shard: torch's
``torch.nn.utils.clip_grad_norm_`` over ``fsdp.parameters()`` would see this rank's shard only),
``opt.step()``. FSDP's default units put each block in its own unit and keep the tied embedding in the
root unit.

The data is synthetic and learnable: every sequence counts up from a random token with a random stride
(1, 2 or 3), so the loss falls from ln(vocab) towards zero within a few dozen steps. Each rank draws its own
batch from (step, rank), so a resumed run sees the same data it would have seen. Every ``--checkpoint-every``
steps the model (sharded), the optimizer state and the step are saved under ``--checkpoint-dir``; with
``--resume`` the run continues from the newest complete checkpoint there.
"""

from __future__ import annotations

import argparse
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

import paramplane as pp

VOCAB = 64
SEQ = 32
STRIDES = (1, 2, 3)


class Block(torch.nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x: Any) -> Any:
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
    """A small GPT for when transformers is not installed: ``model(input_ids, labels)`` returns the loss."""

    def __init__(self, vocab: int = VOCAB, seq: int = SEQ, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, dim)
        self.wpe = torch.nn.Embedding(seq, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's
        for emb in (self.wte, self.wpe):
            torch.nn.init.normal_(emb.weight, std=0.02)  # GPT-2's: N(0, 1) tied to the head starts far off

    def forward(self, input_ids: Any, labels: Any = None) -> Any:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1)
        )


def build_model(seed: int = 0) -> tuple[Any, str]:
    """The model (same weights on every rank for ``seed``) and its name."""
    torch.manual_seed(seed)
    try:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return TinyGPT(), "TinyGPT (this example's own; install transformers for GPT-2)"
    warnings.filterwarnings("ignore", module="transformers")
    cfg = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    return GPT2LMHeadModel(cfg), "transformers GPT2LMHeadModel"


def batch(step: int, rank: int, size: int) -> Any:
    """Rank ``rank``'s token ids for ``step``: ``size`` sequences counting up with a random stride."""
    rng = np.random.default_rng(step * 1000 + rank)
    start = rng.integers(0, VOCAB, (size, 1))
    stride = rng.choice(STRIDES, (size, 1))
    return torch.from_numpy((start + stride * np.arange(SEQ)) % VOCAB)


def loss_of(output: Any) -> Any:
    """The loss in a model's output: a tensor, or transformers' ``ModelOutput.loss``."""
    return output if torch.is_tensor(output) else output.loss


def train(world: pp.World, args: argparse.Namespace) -> list[float]:
    group = world.group
    model, name = build_model()
    params = sum(p.numel() for p in model.parameters())
    fsdp = pp.FSDP(model, group, "full_shard")  # default units: one per block, the tied embedding in the root
    opt = torch.optim.AdamW(fsdp.parameters(), lr=args.lr, weight_decay=0.01)
    # optim_state: AdamW's moments cut by module parameter, so a checkpoint reshards like the model.
    state = {"model": fsdp, "optim": fsdp.optim_state(opt), "step": 0}
    start = 0
    resume = pp.checkpoint.latest(args.checkpoint_dir) if args.resume else None
    if resume is not None:
        start = pp.checkpoint.load(state, resume, group)["step"]
    if world.rank == 0:
        where = f"resumed from {resume} at step {start}" if resume else "from scratch"
        print(f"{name}: {params} parameters, FSDP full_shard on {group.size} ranks, {where}", flush=True)
        if start >= args.steps:
            print(f"nothing to train: already at step {start}; pass a larger --steps", flush=True)
    local = max(1, args.batch_size // group.size)
    losses = []
    mean = np.zeros(1)
    fsdp.train()
    for step in range(start, args.steps):
        ids = batch(step, world.rank, local)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_of(fsdp(input_ids=ids, labels=ids))
        loss.backward()  # shard gradients are averaged over the ranks when this returns
        norm = fsdp.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean[0] = float(loss.detach())
        group.all_reduce(mean, "mean")
        losses.append(float(mean[0]))
        if world.rank == 0:
            print(f"step {step + 1}/{args.steps}: loss {mean[0]:.4f} grad norm {norm:.3f}", flush=True)
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            state["step"] = step + 1
            path = pp.checkpoint.save(state, args.checkpoint_dir / f"step_{step + 1:06d}", group, keep=2)
            if world.rank == 0:
                print(f"checkpoint: {path}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="train up to this step (default 40)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("gpt_ckpt"))
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir"
    )
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size, args.checkpoint_every) < 1 or not args.lr > 0:
        parser.error("--steps, --batch-size, --checkpoint-every and --lr must be positive")
    newest = pp.checkpoint.latest(args.checkpoint_dir)
    if newest is not None and not args.resume:
        parser.error(
            f"{args.checkpoint_dir} holds checkpoints ({newest.name}): pass --resume, or another dir"
        )
    with pp.init() as world:
        losses = train(world, args)
        if world.rank == 0 and len(losses) > 1:
            drop = f"{losses[0]:.4f} -> {losses[-1]:.4f} (ln(vocab) = {math.log(VOCAB):.2f})"
            print(f"loss {drop}", flush=True)
        world.group.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
