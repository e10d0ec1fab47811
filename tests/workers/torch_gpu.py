"""``torch_gpu.py STRATEGY...``: pp.DDP ("ddp") and pp.FSDP strategies over a torch module on CUDA.

Each rank takes its GPU (``world.use_gpu()``: ranks share one GPU where there are fewer), moves a float32
model there and trains the standard loop (``loss.backward()``, clipping, a torch optimizer's step) on its
shard of the batch. Gradients move as cupy views of torch's CUDA tensors (NCCL inside the host). After
every step the loss and the full parameters equal one process on the whole batch on the same GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp

STEPS = 3
BATCH = 4  # per rank
RTOL = 1e-4  # float32 on a GPU: reduction order differs between one process and the ranks


def _model(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 16),
        torch.nn.GELU(),
        torch.nn.Linear(16, 4),
    )


def _batch(step: int, rank: int) -> tuple[Any, Any]:
    import torch

    rng = np.random.default_rng(step * 100 + rank)
    return (
        torch.from_numpy(rng.standard_normal((BATCH, 8)).astype(np.float32)).cuda(),
        torch.from_numpy(rng.standard_normal((BATCH, 4)).astype(np.float32)).cuda(),
    )


def _full(wrapper: Any) -> np.ndarray:
    state = wrapper.state_dict()
    return np.concatenate([np.asarray(_host(state[k])).reshape(-1) for k in sorted(state)])


def _host(value: Any) -> Any:
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()
    return value.get() if hasattr(value, "get") else value


def scenario(world: Any, rep: Report) -> None:
    import torch

    device = world.use_gpu()
    torch.cuda.set_device(device)
    n, me = world.world_size, world.rank
    for kind in sys.argv[1:]:
        model = _model(seed=me).cuda()  # differs per rank: the wrap makes every rank use rank 0's
        wrapper: Any = pp.DDP(model, world.group) if kind == "ddp" else pp.FSDP(model, world.group, kind)
        opt = torch.optim.AdamW(wrapper.parameters(), lr=0.01)
        ref = _model(seed=0).cuda()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
        for step in range(STEPS):
            x, y = _batch(step, me)
            loss = torch.nn.functional.mse_loss(wrapper(x), y)
            loss.backward()
            if kind == "ddp":
                torch.nn.utils.clip_grad_norm_(wrapper.parameters(), 0.05)
            else:
                wrapper.clip_grad_norm_(0.05)
            opt.step()
            opt.zero_grad(set_to_none=True)
            xs, ys = zip(*(_batch(step, r) for r in range(n)))
            ref_loss = torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys))
            ref_loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            mine = np.array([float(loss)])
            world.group.all_reduce(mine, "mean")
            rep.equal(f"{kind} step {step}: mean loss", mine, np.array([float(ref_loss)]), rtol=RTOL)
        want = np.concatenate(
            [p.detach().cpu().numpy().reshape(-1) for _, p in sorted(ref.state_dict().items())]
        )
        rep.equal(f"{kind}: parameters equal one process", _full(wrapper), want, rtol=RTOL)
        rep.check(
            f"{kind}: the optimizer's parameters stay on the GPU",
            all(p.is_cuda for p in wrapper.parameters()),
        )


if __name__ == "__main__":
    run_rank(scenario)
