"""Checkpoints of a torch loop under pp.DDP (transformers' GPT-2, torch's AdamW, world 2): ``{"model": ddp,
"optim": ddp.optim_state(opt), "step": step}`` saved after 2 steps loads into a fresh pp.DDP and into a fresh
pp.FSDP (full_shard: the optimizer state resharded by parameter name), each with a fresh optimizer of another
learning rate, and one more step there equals one process's third step; a bare torch optimizer in the state is
a CheckpointError on every rank naming ``optim_state``, before anything is written.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, run_rank

import paramplane as pp

LR = 1e-2


def _steps(model: Any, opt: Any, steps: range, rank: int | None, n: int) -> None:
    for step in steps:
        batch = tm.global_batch("gpt2", step, n) if rank is None else tm.batch("gpt2", step, rank)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def scenario(world: Any, rep: Report) -> None:
    import torch

    g, n, rank = world.group, world.world_size, world.rank
    path = Path(os.environ["PARAMPLANE_TEST_OUT"]) / "ckpt"
    ref = tm.build("gpt2")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    _steps(ref, ref_opt, range(3), None, n)
    want = np.concatenate([v.reshape(-1).numpy() for v in ref.state_dict().values()])

    ddp = pp.DDP(tm.build("gpt2"), g)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    _steps(ddp, opt, range(2), rank, n)
    rep.raises(
        "a bare torch optimizer in a checkpoint",
        pp.checkpoint.CheckpointError,
        lambda: pp.checkpoint.save({"model": ddp, "optim": opt}, path / "bare", g),
        "optim_state(opt)",
    )
    rep.check("nothing was written for it", not (path / "bare").exists(), "")
    pp.checkpoint.save({"model": ddp, "optim": ddp.optim_state(opt), "step": 2}, path / "step2", g)
    for how in ("ddp", "full_shard"):
        model = tm.build("gpt2", seed=5)
        wrapped: Any = pp.DDP(model, g) if how == "ddp" else pp.FSDP(model, g, how)
        fresh = torch.optim.AdamW(wrapped.parameters(), lr=0.5)
        got = pp.checkpoint.load(
            {"model": wrapped, "optim": wrapped.optim_state(fresh), "step": 0}, path / "step2", g
        )
        rep.check(f"{how}: the saved step", got["step"] == 2, str(got["step"]))
        rep.check(f"{how}: the saved learning rate", fresh.param_groups[0]["lr"] == LR, "")
        _steps(wrapped, fresh, range(2, 3), rank, n)
        state = wrapped.state_dict()
        rep.close(f"{how}: one step after loading = one process's third", np.concatenate(
            [v.reshape(-1).numpy() for v in state.values()]), want, 1e-9)  # fmt: skip


if __name__ == "__main__":
    run_rank(scenario)
