"""``torch.distributed`` calls on CUDA tensors over ``pp.init_torch_distributed(world)`` (two ranks, one GPU each
or shared): NCCL inside the host for all_reduce / broadcast / all_gather / reduce_scatter, host staging for
all_to_all, every result computed from all ranks' known inputs; torch's own DistributedDataParallel on a CUDA
module over the backend equals one process on the whole batch."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp

STEPS = 3


def scenario(world: Any, rep: Report) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device("cuda", world.use_gpu())
    pp.init_torch_distributed(world)
    r, n = world.rank, world.world_size

    def value(i: int) -> Any:
        return torch.tensor([i + 1.0, 2.0 * i - 1.0, 0.5 + i], dtype=torch.float32, device=device)

    every = [value(i) for i in range(n)]
    t = value(r)
    dist.all_reduce(t)
    rep.check("all_reduce of a CUDA tensor", torch.allclose(t, sum(every)), f"{t}")
    t = value(r)
    dist.all_reduce(t, async_op=True).wait()
    rep.check("async all_reduce of a CUDA tensor", torch.allclose(t, sum(every)), f"{t}")
    t = value(r)
    dist.broadcast(t, src=n - 1)
    rep.check("broadcast of a CUDA tensor", torch.equal(t, every[-1]), f"{t}")
    flat = torch.empty(3 * n, device=device)
    dist.all_gather_into_tensor(flat, value(r))
    rep.check("all_gather_into_tensor on CUDA", torch.equal(flat, torch.cat(every)), f"{flat}")
    outs = [torch.empty(3, device=device) for _ in range(n)]
    dist.all_gather(outs, value(r))
    rep.check(
        "all_gather into a list on CUDA", all(torch.equal(o, e) for o, e in zip(outs, every)), f"{outs}"
    )
    out = torch.empty(3, device=device)
    dist.reduce_scatter_tensor(out, torch.cat([value(r) * (i + 1) for i in range(n)]))
    rep.check("reduce_scatter_tensor on CUDA", torch.allclose(out, sum(every) * (r + 1)), f"{out}")
    blocks = torch.cat([value(r) * (i + 1) for i in range(n)])
    got = torch.empty_like(blocks)
    dist.all_to_all_single(got, blocks)
    rep.check(
        "all_to_all_single on CUDA", torch.allclose(got, torch.cat([e * (r + 1) for e in every])), f"{got}"
    )
    dist.barrier()

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(5)
    for _step in range(STEPS):
        xs = [torch.randn(4, 8, generator=gen).to(device) for _ in range(n)]
        ys = [torch.randn(4, 4, generator=gen).to(device) for _ in range(n)]
        torch.nn.functional.mse_loss(ddp(xs[r]), ys[r]).backward()
        opt.step()
        opt.zero_grad()
        (sum(torch.nn.functional.mse_loss(ref(x), y) for x, y in zip(xs, ys)) / n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    rep.check(
        "torch's DDP on a CUDA module over the backend = one process",
        all(torch.allclose(p, q, rtol=1e-4, atol=1e-6) for p, q in zip(model.parameters(), ref.parameters())),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    run_rank(scenario)
