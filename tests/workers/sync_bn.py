"""``pp.SyncBatchNorm`` / ``pp.convert_sync_batchnorm``: BatchNorm statistics over the whole group's batch.

``layer``: one layer, uneven batches (rank r holds r + 2 samples), float64: the outputs, the input gradients
(of the sum of every rank's loss), the running statistics and the summed weight and bias gradients equal one
process's BatchNorm on the concatenated batch; eval mode and a group of one are a plain BatchNorm; bad input
is a ValueError.

``train``: torchvision's ResNet-18 and transformers' ResNet converted, under pp.DDP (and the latter under
pp.FSDP full_shard): every step's loss, the final parameters and the running statistics equal one process
on the whole batch with plain BatchNorm (which DDP alone cannot: its statistics are per rank).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, digest, run_rank

import paramplane as pp

STEPS = 3


def _x(rank: int, channels: int = 3) -> Any:
    import torch

    rng = np.random.default_rng(50 + rank)
    # an offset far from zero: a one-pass variance (E[x^2] - mean^2) would lose digits here
    return torch.from_numpy(rng.standard_normal((rank + 2, channels, 4, 5)) * 3.0 + 40.0)


def layer(world: Any, rep: Report) -> None:
    import torch

    n, rank = world.world_size, world.rank
    torch.manual_seed(0)
    plain = torch.nn.BatchNorm2d(3, momentum=0.3).double()
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-1, 1)
    sync = pp.convert_sync_batchnorm(torch.nn.Sequential(plain), world.group)[0]
    rep.check("converted", type(sync).__name__ == "SyncBatchNorm", type(sync).__name__)
    ref = torch.nn.BatchNorm2d(3, momentum=0.3).double()
    ref.load_state_dict(plain.state_dict())
    rng = np.random.default_rng(7)
    weights = [
        torch.from_numpy(rng.standard_normal(_x(r).shape)) for r in range(n)
    ]  # each rank's loss weights

    x = _x(rank).requires_grad_(True)
    for step in range(2):  # twice: the running statistics move with the momentum
        y = sync(x)
        (y * weights[rank]).sum().backward()
        xs = [_x(r).requires_grad_(True) for r in range(n)]
        y_ref = ref(torch.cat(xs))
        (y_ref * torch.cat(weights)).sum().backward()
        lo = sum(r + 2 for r in range(rank))
        rows = slice(lo, lo + rank + 2)
        rep.equal(f"{step}: output", y.detach().numpy(), y_ref.detach().numpy()[rows], rtol=1e-10)
        rep.close(
            f"{step}: input gradient", x.grad.numpy(), torch.cat([t.grad for t in xs]).numpy()[rows], 1e-10
        )
        grads = torch.cat([sync.weight.grad, sync.bias.grad]).clone()
        world.group.all_reduce(grads, "sum")  # the local parts: DDP reduces them
        rep.close(f"{step}: weight and bias gradients", grads.numpy(),
                  torch.cat([ref.weight.grad, ref.bias.grad]).numpy(), 1e-10)  # fmt: skip
        rep.close(f"{step}: running mean", sync.running_mean.numpy(), ref.running_mean.numpy(), 1e-12)
        rep.close(f"{step}: running var", sync.running_var.numpy(), ref.running_var.numpy(), 1e-12)
        for t in (x, sync.weight, sync.bias, ref.weight, ref.bias):
            t.grad = None
    rep.check("batches tracked", int(sync.num_batches_tracked) == 2)
    sync.eval()
    ref.eval()
    with torch.no_grad():
        rep.equal("eval: running statistics", sync(_x(rank)).numpy(), ref(_x(rank)).numpy(), rtol=1e-12)
    sync.train()
    solo = pp.SyncBatchNorm(3, world.new_group([rank])).double()  # a group of one: a plain BatchNorm
    rep.check("a SyncBatchNorm is a BatchNorm", isinstance(solo, torch.nn.modules.batchnorm._BatchNorm))
    alone = torch.nn.BatchNorm2d(3).double()
    rep.equal("a group of one", solo(_x(rank)).detach().numpy(), alone(_x(rank)).detach().numpy(), rtol=0)
    for name, bad in (("a 1-D input", lambda: sync(torch.zeros(3, dtype=torch.float64))),
                      ("no group", lambda: pp.convert_sync_batchnorm(plain, None)),
                      ("wrong channels", lambda: sync(torch.zeros(2, 4, 3, dtype=torch.float64)))):  # fmt: skip
        try:
            bad()
            rep.check(f"{name} is refused", False)
        except ValueError:
            rep.check(f"{name} is refused", True)


def train(world: Any, rep: Report) -> None:
    import torch

    n, rank = world.world_size, world.rank
    cases = [("resnet18", "ddp"), ("resnet", "ddp"), ("resnet", "fsdp")]
    for name, how in cases:
        if name not in tm.MODELS:
            continue
        model = pp.convert_sync_batchnorm(tm.build(name, seed=0), world.group)
        wrapped = pp.DDP(model, world.group) if how == "ddp" else pp.FSDP(model, world.group, "full_shard")
        ref = tm.build(name, seed=0)
        opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(STEPS):
            loss = tm.image_loss(wrapped, tm.batch(name, step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref_loss = tm.image_loss(ref, tm.global_batch(name, step, n))
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            # the loss of this rank's samples, against one process's loss on the whole batch: their mean
            mean = world.group.all_reduce(np.array([float(loss)]), "mean")
            rep.close(f"{name} {how} step {step}: loss", mean, np.array([float(ref_loss)]), 1e-9)
        state = wrapped.state_dict() if how == "fsdp" else model.state_dict()
        want = ref.state_dict()
        rep.check(f"{name} {how}: state keys", list(state) == list(want))
        for key in want:
            rep.close(f"{name} {how}: {key}", state[key].double().numpy(), want[key].double().numpy(), 1e-8)
        rep.digests[f"{name}/{how}"] = digest(
            np.concatenate([v.double().reshape(-1).numpy() for v in state.values()])
        )


if __name__ == "__main__":
    run_rank({"layer": layer, "train": train}[sys.argv[1]])
