"""Train a GPT in 3-D: data x pipeline x tensor parallel on one mesh (dp 2 x pp 2 x tp 2 on 8 ranks by default).

    paramplane launch --standalone -n 8 examples/train_gpt_3d.py --steps 30
    paramplane launch --standalone -n 4 examples/train_gpt_3d.py --dp 1 --pp 2 --tp 2
    paramplane launch --standalone -n 8 examples/train_gpt_3d.py --dp 1 --pp 4 --tp 2 --resume
    paramplane launch --standalone -n 8 examples/train_gpt_3d.py --dp-wrapper fsdp

One ``pp.Mesh(world, dp=, pp=, tp=)`` gives every group: the model (``transformers`` GPT-2 at a tiny
config, built the same on every rank) is cut into ``pp`` stages by ``pp.pipeline_split`` (the embedding with
the first, the final norm and the tied head with the last); this rank's stage is split over ``tp`` by
``pp.parallelize`` with ``pp.tp_plan_for`` (attention heads, MLP, vocabulary-parallel embedding and head);
``pp.DDP`` over ``dp`` averages the stage's gradients once per step (``--dp-wrapper fsdp``: ``pp.FSDP`` shards
the stage's parameters, gradients and AdamW state over ``dp`` and reduce-scatters the gradients once per step,
after the last microbatch); ``pp.Pipeline`` runs the 1F1B schedule
over ``pp`` (``--schedule``), one optimizer step per global batch, with the global gradient norm clipped
(``Pipeline.clip_grad_norm_``). Any factorisation of the world works where ``pp`` divides the layers
(``--layers``, default 4) and ``tp`` divides the heads (4) and the vocabulary (64); with ``--model tinygpt``
(the project's own torch GPT from ``train_gpt.py``, whose attention is torch's MultiheadAttention) tp must be 1.

The data is the synthetic counting task of ``train_gpt.py``: the loss falls from ln(64) towards zero. The
model is saved under ``--checkpoint-dir`` every ``--checkpoint-every`` steps as the dense model (each stage's
tensor-parallel pieces, under the full model's parameter names); ``--resume`` loads it straight into this
rank's stages after cutting and splitting the model (each rank reads only its own parameters), so it continues
at any other factorisation. AdamW's state is saved beside it under the dense model's keys
(``pipe.optim_state(opt)``, ``pp.pipeline_optim_state``) and restored on ``--resume`` at any factorisation
and with either ``--dp-wrapper``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from train_gpt import SEQ, VOCAB, TinyGPT, batch

import paramplane as pp
from paramplane.parallel.sharding import ShardedArray


class Stages:
    """This rank's stage modules as one model to save: their (tensor-parallel) states under the full model's
    parameter names; the ranks together save the dense model, which loads at any dp x pp x tp. FSDP-wrapped
    stages are gathered for it (``summon_full_params``) and their values copied."""

    def __init__(self, stages: list[Any], wrapped: list[Any]) -> None:
        self.stages = stages
        self.wrapped = wrapped

    def sharded_state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s, w in zip(self.stages, self.wrapped):
            fsdp = isinstance(w, pp.FSDP)
            with w.summon_full_params() if fsdp else contextlib.nullcontext():
                state = s.sharded_state_dict() if hasattr(s, "sharded_state_dict") else s.state_dict()
                out.update({k: _copy(v) for k, v in state.items()} if fsdp else state)
        return out

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """The stages' plain tensors were filled in place; tensor-parallel pieces finish loading here."""
        if any(w is not s for s, w in zip(self.stages, self.wrapped)):
            raise ValueError("load the checkpoint into the stages before wrapping them in pp.DDP / pp.FSDP")
        for s in self.stages:
            if hasattr(s, "load_sharded_state_dict"):
                s.load_sharded_state_dict(state)


def _copy(value: Any) -> Any:
    """A state value that outlives ``summon_full_params`` (which reshards the gathered parameters after it)."""
    if isinstance(value, ShardedArray):
        return ShardedArray(value.global_shape, value.start, value.local.copy())
    return value.detach().clone()


def build_model(name: str, layers: int) -> Any:
    torch.manual_seed(0)
    if name == "tinygpt":
        return TinyGPT(layers=layers)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", module="transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0
    )
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


def train(world: pp.World, args: argparse.Namespace) -> list[float]:
    mesh = pp.Mesh(world, dp=args.dp, pp=args.pp, tp=args.tp)
    chunks = 2 if args.schedule == "interleaved_1f1b" else 1
    num_stages = args.pp * chunks
    model = build_model(args.model, args.layers)
    total = sum(p.numel() for p in model.parameters())
    start = 0
    resume = pp.checkpoint.latest(args.checkpoint_dir) if args.resume else None
    stages = pp.pipeline_split(model, [args.layers * s // num_stages for s in range(1, num_stages)])
    mine = stages[mesh.coordinate("pp") :: args.pp]
    for stage in mine:
        if args.tp > 1:
            pp.parallelize(stage, mesh.group("tp"), pp.tp_plan_for(stage))
    if resume is not None:  # each rank reads its stages' parameters (its tensor-parallel pieces) only
        start = pp.checkpoint.load({"model": Stages(mine, mine), "step": 0}, resume, world.group)["step"]
    wrapper = pp.FSDP if args.dp_wrapper == "fsdp" else pp.DDP
    wrapped = [wrapper(s, mesh.group("dp")) if args.dp > 1 else s for s in mine]
    pipe = pp.Pipeline(
        wrapped if chunks > 1 else wrapped[0],
        mesh.group("pp"),
        args.schedule,
        args.microbatches,
        loss_fn=pp.causal_lm_loss,
    )
    params = [p for w in wrapped for p in w.parameters()]  # FSDP: this rank's shards
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    state: dict[str, Any] = {"model": Stages(mine, wrapped), "optim": pipe.optim_state(opt), "step": start}
    if resume is not None and any(
        k.startswith("optim/") for k in pp.checkpoint.read_manifest(resume)["arrays"]
    ):
        pp.checkpoint.load({"optim": state["optim"]}, resume, world.group)
    if world.rank == 0:
        where = f"resumed from {resume} at step {start}" if resume else "from scratch"
        print(f"{args.model}: {total} parameters; {mesh}; {args.schedule}, {where}", flush=True)
    local = args.batch_size // args.dp
    d = mesh.coordinate("dp")
    report = mesh.group(("pp", "dp"))  # the last stage's replicas hold the losses
    losses = []
    mean = np.zeros(1)
    for step in range(start, args.steps):
        # This replica's share of the global batch, drawn from (step, replica, microbatch).
        m = args.microbatches
        ids = torch.cat([batch(step, d * m + r, local // m) for r in range(m)])
        out = pipe.step(ids if pipe.is_first else None, target=ids if pipe.is_last else None)
        norm = pipe.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean[0] = float(np.mean(out)) if out is not None else 0.0
        report.all_reduce(mean, "sum")
        losses.append(float(mean[0]) / args.dp)
        if world.rank == 0:
            print(
                f"step {step + 1}/{args.steps}: loss {losses[-1]:.6f} grad norm {float(norm):.6f}", flush=True
            )
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            state["step"] = step + 1
            path = pp.checkpoint.save(
                state, args.checkpoint_dir / f"step_{step + 1:06d}", world.group, keep=2
            )
            if world.rank == 0:
                print(f"checkpoint: {path}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--model", default="gpt2", choices=("gpt2", "tinygpt"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    parser.add_argument("--dp-wrapper", default="ddp", choices=("ddp", "fsdp"), help="over the dp axis")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, split over dp replicas")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("gpt3d_ckpt"))
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    if min(args.dp, args.pp, args.tp, args.layers, args.microbatches, args.steps, args.checkpoint_every) < 1:
        parser.error("sizes, --steps and --checkpoint-every must be positive")
    if args.batch_size % (args.dp * args.microbatches):
        parser.error("--batch-size must split into dp x microbatches equal parts")
    if args.model == "tinygpt" and args.tp > 1:
        parser.error(
            "--model tinygpt uses torch's MultiheadAttention, which tensor parallel does not split: --tp 1"
        )
    newest = pp.checkpoint.latest(args.checkpoint_dir)
    if newest is not None and not args.resume:
        parser.error(
            f"{args.checkpoint_dir} holds checkpoints ({newest.name}): pass --resume, or another dir"
        )
    with pp.init() as world:
        if world.world_size != args.dp * args.pp * args.tp:
            raise SystemExit(
                f"dp x pp x tp = {args.dp * args.pp * args.tp}, but the world has {world.world_size} ranks"
            )
        losses = train(world, args)
        if world.rank == 0 and len(losses) > 1:
            print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} (ln(vocab) = {math.log(VOCAB):.2f})", flush=True)
        world.group.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
