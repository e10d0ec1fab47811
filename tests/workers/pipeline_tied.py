"""A weight tied across pipeline stages stays bit-identical at dp 3 (pp 2 x dp 3 on 6 ranks).

GPT-2's embedding is its head's weight: ``pp.pipeline_split`` leaves one copy on the first stage and one on the
last. Each stage is wrapped in ``pp.DDP`` or ``pp.FSDP`` over its own dp group and the test runs with
``PARAMPLANE_TRANSPORT=grpc``, where a payload over 256 KiB is reduced by a ring whose reduce-scatter starts
each chunk's sum at another rank: at dp 3 an element's three addends are grouped by the chunk it falls in,
and the tied weight falls in different chunks of the two stages' flat gradients. After every AdamW step the
two copies must be equal bit for bit, and the losses and the tied weight must equal one process on the whole
batch (float64, 1e-9), and a checkpoint of the model and AdamW (which saves the tied moments once, from both
stages, checking that they agree) succeeds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp

STEPS, MICROBATCHES, ROWS, SEQ = 3, 2, 12, 8  # ROWS: the global batch, 2 rows per microbatch on each replica
VOCAB = 4096  # the tied weight alone: 4096 x 16 float64 = 512 KiB, above the ring's 256 KiB threshold
RTOL = 1e-9


def build() -> Any:
    import warnings

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ)
    cfg.attn_pdrop = cfg.resid_pdrop = cfg.embd_pdrop = 0.0
    return GPT2LMHeadModel(cfg).double()


def batch(step: int) -> dict[str, Any]:
    import torch

    ids = torch.from_numpy(np.random.default_rng(step).integers(0, VOCAB, (ROWS, SEQ)))
    return {"input_ids": ids, "labels": ids.clone()}


def run_case(world: Any, rep: Report, wrapper: str) -> None:
    import torch

    mesh = pp.Mesh(world, dp=3, pp=2)
    dp, p = mesh.group("dp"), mesh.group("pp")
    stage = pp.pipeline_split(build(), [1])[p.rank]
    wrapped = pp.FSDP(stage, dp) if wrapper == "fsdp" else pp.DDP(stage, dp)
    pipe = pp.Pipeline(wrapped, p, "1f1b", MICROBATCHES, loss_fn=pp.causal_lm_loss)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    key = "transformer.wte.weight" if pipe.is_first else "lm_head.weight"
    rows = ROWS // dp.size
    loss = np.zeros(1)
    for step in range(STEPS):
        b = batch(step)
        mine = {k: v[dp.rank * rows : (dp.rank + 1) * rows] for k, v in b.items()}
        losses = pipe.step(
            mine["input_ids"] if pipe.is_first else None, target=mine["labels"] if pipe.is_last else None
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        want = pp.causal_lm_loss(ref(input_ids=b["input_ids"]).logits, b["labels"])
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        loss[0] = np.mean(losses) if losses is not None else 0.0
        mesh.group(("pp", "dp")).all_reduce(loss, "sum")
        rep.close(f"{wrapper} loss {step}", loss[0] / dp.size, float(want), RTOL)
        copy = np.ascontiguousarray(wrapped.state_dict()[key].detach().numpy())
        both = p.all_gather(copy).reshape(2, -1)  # the first stage's copy, then the last stage's
        differ = int(np.count_nonzero(both[0].view(np.int64) != both[1].view(np.int64)))
        rep.check(
            f"{wrapper} tied copies bit-equal after step {step}", differ == 0, f"{differ} elements differ"
        )
        rep.close(f"{wrapper} tied weight {step}", copy, ref.lm_head.weight.detach().numpy(), RTOL)
    # The tied weight's AdamW moments are saved once, from both stages: the save checks that they agree.
    out = Path(os.environ["PARAMPLANE_TEST_OUT"]) / f"ckpt-{wrapper}"
    saved = {"model": wrapped, "optim": pipe.optim_state(opt), "step": STEPS}
    try:
        pp.checkpoint.save(saved, out, world.group)
        rep.check(f"{wrapper} save with the tied moments", True)
    except Exception as exc:
        rep.check(f"{wrapper} save with the tied moments", False, f"{type(exc).__name__}: {exc}")


def scenario(world: Any, rep: Report) -> None:
    for wrapper in ("ddp", "fsdp"):
        run_case(world, rep, wrapper)


if __name__ == "__main__":
    run_rank(scenario)
