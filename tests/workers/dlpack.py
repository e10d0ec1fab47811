"""Collectives and checkpoints on torch CPU tensors (DLPack, zero-copy): in-place ops change the caller's tensor."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank

import paramplane as pp


def scenario(world: Any, rep: Report) -> None:
    import torch

    g, n, me = world.group, world.world_size, world.rank
    t = torch.full((3, 4), float(me + 1))
    ptr = t.data_ptr()
    same = g.all_reduce(t, "sum")
    rep.check("all_reduce in place", same is t and t.data_ptr() == ptr, "not the caller's tensor")
    rep.equal("all_reduce value", t.numpy(), np.full((3, 4), float(sum(range(1, n + 1))), np.float32))
    b = torch.full((5,), me, dtype=torch.int64)
    g.broadcast(b, src=n - 1)
    rep.equal("broadcast", b.numpy(), np.full(5, n - 1, np.int64))
    gathered = g.all_gather(torch.tensor([me], dtype=torch.float64))
    rep.check("all_gather gives a tensor", isinstance(gathered, torch.Tensor), type(gathered).__name__)
    rep.equal("all_gather", np.asarray(gathered), np.arange(n, dtype=np.float64))
    out = torch.empty(2, dtype=torch.float32)
    got = g.reduce_scatter(torch.ones(2 * n, dtype=torch.float32), out=out)
    rep.check("reduce_scatter into out", got is out, type(got).__name__)
    rep.equal("reduce_scatter", out.numpy(), np.full(2, float(n), np.float32))
    # scatter: torch pieces on the source, a torch buffer elsewhere (filled in place); each rank gets its row.
    if me == 0:
        mine = g.scatter([torch.full((2,), float(r), dtype=torch.float64) for r in range(n)], src=0)
    else:
        buffer = torch.zeros(2, dtype=torch.float64)
        mine = g.scatter(buffer, src=0)
        rep.check("scatter fills the caller's tensor", mine is buffer, type(mine).__name__)
    rep.check("scatter gives a tensor", isinstance(mine, torch.Tensor), type(mine).__name__)
    rep.equal("scatter", np.asarray(mine), np.full(2, float(me)))
    if me == 0:
        g.send(torch.arange(4, dtype=torch.int32), 1)
    elif me == 1:
        r = torch.zeros(4, dtype=torch.int32)
        g.recv(r, 0)
        rep.equal("recv into a tensor", r.numpy(), np.arange(4, dtype=np.int32))
    rep.raises(
        "non-contiguous",
        ValueError,
        lambda: g.all_reduce(torch.ones(3, 4).t()),
        "C-contiguous",
        ".contiguous()",
    )
    rep.raises(
        "unsupported dtype",
        ValueError,
        lambda: g.all_reduce(torch.ones(2, dtype=torch.complex64)),
        "not supported",
    )

    # Checkpoints: torch tensors are saved and loaded in place (the caller's tensors change).
    import shutil
    import tempfile

    root = Path(tempfile.gettempdir()) / f"pp-dlpack-{world.job_id}"
    weights = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "step": 7,
    }  # replicated: equal everywhere
    saved = pp.checkpoint.save({"model": weights["w"], "step": weights["step"]}, root / "ckpt", g)
    target = torch.zeros(2, 3)
    plain = pp.checkpoint.load({"model": target, "step": 0}, saved, g)
    rep.check(
        "checkpoint loads into the torch tensor in place",
        torch.equal(target, weights["w"]),
        str(target),
    )
    rep.check("checkpoint plain values come back", plain.get("step") == 7, str(plain))
    # A torch module (with BatchNorm buffers) round-trips through a checkpoint in place, plain values too.
    torch.manual_seed(me)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    model(torch.randn(4, 3))  # running statistics move
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = pp.checkpoint.save({"model": model, "step": 3}, root / f"module-{me}", world.new_group([me]))
    with torch.no_grad():
        for v in model.state_dict().values():
            v.zero_()
    plain = pp.checkpoint.load({"model": model, "step": 0}, path, world.new_group([me]))
    rep.check(
        "a torch module loads in place",
        all(torch.equal(model.state_dict()[k], v) for k, v in before.items()) and plain == {"step": 3},
        str(plain),
    )
    # A tensor that requires grad is refused by collectives (autograd would not see the change: pass
    # .detach()) but saved and loaded in place by checkpoints; bfloat16 tensors pass like the others.
    param = torch.nn.Parameter(torch.full((3,), float(me)))
    rep.raises(
        "a parameter in a collective", ValueError, lambda: g.broadcast(param, src=n - 1), "requires grad"
    )
    g.broadcast(param.detach(), src=n - 1)
    rep.equal("broadcast into a detached parameter", param.detach().numpy(), np.full(3, n - 1, np.float32))
    alone = world.new_group([me])
    kept = pp.checkpoint.save({"p": param}, root / f"param-{me}", alone)
    with torch.no_grad():
        param.zero_()
    pp.checkpoint.load({"p": param}, kept, alone)
    rep.equal("a parameter loads in place", param.detach().numpy(), np.full(3, n - 1, np.float32))
    half = torch.full((4,), float(me + 1), dtype=torch.bfloat16)
    g.all_reduce(half)
    rep.equal(
        "bfloat16 all_reduce", half.float().numpy(), np.full(4, float(sum(range(1, n + 1))), np.float32)
    )
    # DDP over a torch module with a "sum" reduction: two synchronised backwards accumulate (no zero_grad);
    # the second must not sum the first one's (already summed) gradient once per rank.
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 1, bias=False).double()
    ddp = pp.DDP(lin, g, reduce_op="sum")
    for _ in range(2):
        lin(torch.full((1, 3), float(me + 1), dtype=torch.float64)).sum().backward()
        ddp.finish_gradient_sync()
    want = 2.0 * sum(range(1, n + 1))
    rep.equal("torch DDP sum over synced backwards", lin.weight.grad.numpy(), np.full((1, 3), want))
    g.barrier()
    if me == 0:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_rank(scenario)
