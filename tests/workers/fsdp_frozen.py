"""Frozen parameters under pp.FSDP with ``use_orig_params``: a LoRA fine-tuning (peft over transformers' GPT-2,
float64, world 2) and a frozen teacher.

peft freezes the base model and adds trainable adapters inside its blocks, so every unit mixes frozen and
trainable parameters. With ``use_orig_params=True`` (FSDP1's condition for mixed units) the frozen base is sharded
with the adapters: outside the forward the module's parameters hold placeholders only; inside a step no more
than a few units are gathered at once (a unit holding frozen parameters reshards once its module's input
gradients are computed, not at the end of the backward); losses, adapters and the full state equal one process
(and pp.DDP's the same), and torch FSDP2's (``fully_shard`` over gloo: losses, and the share of the frozen base
each rank holds). A wholly frozen teacher is sharded too and its logits equal the plain model's.
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

STEPS = 3
LAYERS = 4


def _lora() -> Any:
    import torch
    from peft import LoraConfig, get_peft_model

    model = tm.build("gpt2", layers=LAYERS)
    torch.manual_seed(1)  # the adapters' initial values (non-zero B: the first step's gradients reach A too)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, init_lora_weights=False
    )
    return get_peft_model(model, config)


def _halves(step: int, rank: int) -> list[dict[str, Any]]:
    """Rank ``rank``'s batch of ``step`` as two microbatches of one row."""
    batch = tm.batch("gpt2", step, rank)
    return [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]


def _train(model: Any, opt: Any, rank: int | None, n: int, clip: Any, halves: bool = False) -> list[float]:
    """``STEPS`` steps of the usual loop; ``rank`` None: one process on every rank's batch; ``halves``: the loss
    is the mean of the two microbatches' (``_halves``)."""
    losses = []
    for step in range(STEPS):
        parts = [rank] if rank is not None else list(range(n))
        if halves:
            loss = sum(tm.loss64(model, h) / 2 for r in parts for h in _halves(step, r)) / len(parts)
        else:
            loss = sum(tm.loss64(model, tm.batch("gpt2", step, r)) for r in parts) / len(parts)
        loss.backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _train_two_forwards_first(fsdp: Any, opt: Any, rank: int) -> list[float]:
    """Each step as a pipeline runs its microbatches: both halves' forwards, then both backwards (the first
    under no_sync)."""
    losses = []
    for step in range(STEPS):
        first, second = (tm.loss64(fsdp, h) / 2 for h in _halves(step, rank))
        with fsdp.no_sync():
            first.backward()
        second.backward()
        fsdp.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float((first + second).detach()))
    return losses


def _fsdp2(world: Any) -> tuple[list[float], int]:
    """torch's FSDP2 over gloo on the same LoRA model (``fully_shard`` per block, then the root), the same loop:
    this rank's losses and the bytes of frozen parameters it holds."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    tm.init_gloo(world)
    model = _lora()
    for block in [m for m in model.modules() if isinstance(m, GPT2Block)]:
        fully_shard(block)
    fully_shard(model)
    frozen = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    trainable = [p for p in model.parameters() if p.requires_grad]
    clip = lambda: torch.nn.utils.clip_grad_norm_(trainable, 1.0)  # noqa: E731
    return _train(model, torch.optim.AdamW(trainable, lr=1e-2), world.rank, world.world_size, clip), frozen


def _mean(g: Any, values: list[float]) -> np.ndarray:
    total = np.array(values)
    g.all_reduce(total)
    return total / g.size


def scenario(world: Any, rep: Report) -> None:
    import torch

    g, n = world.group, world.world_size
    ref = _lora()
    trainable = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(trainable, lr=1e-2)
    want = _train(ref, ref_opt, None, n, lambda: torch.nn.utils.clip_grad_norm_(trainable, 1.0))
    rep.check("the scenario trains adapters only", 0 < len(trainable) < len(list(ref.parameters())), "")

    model = _lora()
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fsdp = pp.FSDP(model, g, "full_shard", use_orig_params=True)
    held = sum(p.untyped_storage().nbytes() for p in model.parameters())
    rep.check(
        "outside the forward the module's parameters, frozen ones included, hold placeholders",
        held < full_bytes / 100,
        f"{held} of {full_bytes} bytes",
    )
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)  # the frozen pieces too, as a script passes them
    fsdp.reset_peak()
    local = _train(model, opt, world.rank, n, lambda: fsdp.clip_grad_norm_(1.0))
    got = _mean(g, local)
    rep.check("losses = one process", bool(np.allclose(got, want, rtol=1e-9)), f"{got} vs {want}")
    theirs, their_frozen = _fsdp2(world)
    rep.check("this rank's losses = torch FSDP2's", bool(np.allclose(local, theirs, rtol=1e-9)), f"{theirs}")
    our_frozen = sum(p.numel() * p.element_size() for p in fsdp.parameters() if not p.requires_grad)
    rep.check(
        "this rank holds as much of the frozen base as under torch FSDP2 (padding aside)",
        abs(our_frozen - their_frozen) <= 0.02 * their_frozen + 8192,
        f"{our_frozen} vs {their_frozen} bytes",
    )
    peak = fsdp.memory_stats()["params_gathered"]["peak"]
    every_unit = sum(u.padded for u in fsdp.units) * 8
    rep.check(
        "a step gathers a few units at a time, not the whole model",
        peak < 0.7 * every_unit,
        f"peak {peak} of {every_unit} bytes",
    )
    frozen_views = [p for p in fsdp.parameters() if not p.requires_grad]
    rep.check(
        "frozen pieces get no gradient (the optimizer skips them)",
        bool(frozen_views) and all(p.grad is None for p in frozen_views),
        str(len(frozen_views)),
    )
    state, ref_state = fsdp.state_dict(), ref.state_dict()
    bad = [
        k for k in ref_state if not np.allclose(state[k].numpy(), ref_state[k].numpy(), rtol=1e-9, atol=1e-12)
    ]
    rep.check(
        "the full state (base and adapters) = one process",
        list(state) == list(ref_state) and not bad,
        str(bad[:3]),
    )

    ddp_model = _lora()
    ddp = pp.DDP(ddp_model, g)
    ddp_trainable = [p for p in ddp_model.parameters() if p.requires_grad]
    ddp_opt = torch.optim.AdamW(ddp_trainable, lr=1e-2)
    got = _mean(
        g, _train(ddp, ddp_opt, world.rank, n, lambda: torch.nn.utils.clip_grad_norm_(ddp_trainable, 1.0))
    )
    rep.check("pp.DDP: losses = one process", bool(np.allclose(got, want, rtol=1e-9)), f"{got} vs {want}")

    ref_halves = _lora()
    trainable = [p for p in ref_halves.parameters() if p.requires_grad]
    clip = lambda: torch.nn.utils.clip_grad_norm_(trainable, 1.0)  # noqa: E731
    want_halves = _train(ref_halves, torch.optim.AdamW(trainable, lr=1e-2), None, n, clip, halves=True)
    model = _lora()
    fsdp = pp.FSDP(model, g, "full_shard", use_orig_params=True)
    got = _mean(g, _train_two_forwards_first(fsdp, torch.optim.AdamW(fsdp.parameters(), lr=1e-2), world.rank))
    rep.check(
        "two forwards before their backwards (a pipeline's order): losses = one process",
        bool(np.allclose(got, want_halves, rtol=1e-9)),
        f"{got} vs {want_halves}",
    )

    teacher = tm.build("gpt2", layers=LAYERS).requires_grad_(False)
    plain = tm.build("gpt2", layers=LAYERS)
    sharded = pp.FSDP(teacher, g, use_orig_params=True)
    held = sum(p.untyped_storage().nbytes() for p in teacher.parameters())
    rep.check("a frozen teacher is sharded", held < full_bytes / 100, f"{held} bytes")
    batch = tm.batch("gpt2", 0, world.rank)
    with torch.no_grad():
        logits, want_logits = sharded(**batch).logits, plain(**batch).logits
    rep.check(
        "the teacher's logits = the plain model's",
        torch.allclose(logits, want_logits, rtol=1e-12, atol=0),
        "",
    )


if __name__ == "__main__":
    run_rank(scenario)
