"""pp.DDP over a torch.nn.Module (CPU): each rank trains on its own shard, a torch optimizer is attached,
and after every step the parameters equal one process training on the whole batch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, digest, run_rank

import paramplane as pp

STEPS = 3
BATCH = 4  # per rank


def _model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3), torch.nn.BatchNorm1d(3)
    ).double()


def _batch(step: int, rank: int) -> tuple[Any, Any]:
    import torch

    rng = np.random.default_rng(step * 100 + rank)
    return torch.from_numpy(rng.standard_normal((BATCH, 5))), torch.from_numpy(
        rng.standard_normal((BATCH, 3))
    )


def scenario(world: Any, rep: Report) -> None:
    import torch

    g, n = world.group, world.world_size
    model = _model(seed=world.rank)  # different on every rank: the wrap-time broadcast makes them rank 0's
    ddp = pp.DDP(model, g, bucket_mb=0.0002)  # small buckets: several all-reduces overlap the backward
    rep.check("several buckets", ddp.num_buckets > 1, str(ddp.num_buckets))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ddp.attach(opt)
    ref = _model(seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step, world.rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        # One process on the whole batch, with the mean loss over it: what DDP must reproduce. BatchNorm's
        # statistics are per rank in DDP (as in torch's DDP), so the reference runs its ranks' shards
        # separately and averages the losses.
        ref_opt.zero_grad()
        total = sum(
            torch.nn.functional.mse_loss(ref(_batch(step, r)[0]), _batch(step, r)[1]) for r in range(n)
        )
        (total / n).backward()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            rep.equal(f"step {step} {name}", p.detach().numpy(), q.detach().numpy(), rtol=1e-10)
    rep.raises("backward on a torch module", RuntimeError, lambda: ddp.backward(None), "loss.backward()")
    rep.raises("a foreign optimizer", ValueError, lambda: ddp.attach(object()), "torch.optim optimizer")
    for name, p in ddp.named_parameters():
        rep.digests[name] = digest(p.detach().numpy())


if __name__ == "__main__":
    run_rank(scenario)
