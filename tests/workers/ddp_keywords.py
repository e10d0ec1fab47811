"""torch 2.13's DDP keywords and torch's DeviceMesh under pp.DDP and pp.FSDP (world 2).

``buffers``: the buffer rules of ``broadcast_buffers`` / ``forward_sync_buffers`` (torch 2.13: the first
decides the wrap-time broadcast and the forwards', the second only the forwards', the wrap-time broadcast
then always on) and the keywords that change nothing here, against torch's DDP over gloo in the same loop: a
BatchNorm model whose ranks start with different running statistics, 3 SGD steps; parameters and buffers equal
torch's on every rank.

``mesh``: over paramplane's torch.distributed backend, ``device_mesh=`` names the group: pp.DDP on a 1-D mesh
equals torch's DDP on the same mesh; pp.FSDP on a 1-D mesh (full_shard) and on 2-D (replicate, shard) meshes
(HYBRID_SHARD, shard size from the mesh) equal one process; a mesh beside a group, a 2-D mesh for DDP or for a
non-hybrid strategy are ValueErrors.
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

CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "broadcast_buffers=False": {"broadcast_buffers": False},
    "forward_sync_buffers=False": {"forward_sync_buffers": False},
    "forward_sync_buffers=True, broadcast_buffers=False": {
        "forward_sync_buffers": True,
        "broadcast_buffers": False,
    },
    "no-op keywords": {
        "dim": 0,
        "check_reduction": False,
        "skip_all_reduce_unused_params": True,
        "batched_grad_copy": True,
        "bucket_cap_mb_list": [0.0005, 0.001],
    },
}


def _bn_model(rank: int) -> Any:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    ).double()
    bn = model[1]
    bn.running_mean.fill_(float(rank))  # ranks start apart: what is broadcast, and when, shows
    bn.running_var.fill_(1.0 + rank)
    return model


def _train_bn(model: Any, rank: int) -> np.ndarray:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        rng = np.random.default_rng(100 * step + rank)
        x = torch.from_numpy(rng.standard_normal((4, 6)) + rank)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    inner = getattr(model, "module", model)
    return np.concatenate([v.double().reshape(-1).numpy() for v in inner.state_dict().values()])


def buffers(world: Any, rep: Report) -> None:
    import warnings

    from torch.nn.parallel import DistributedDataParallel

    tm.init_gloo(world)
    rank = world.rank
    got = {}
    for name, kwargs in CONFIGS.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's FutureWarning for broadcast_buffers
            want = _train_bn(DistributedDataParallel(_bn_model(rank), **kwargs), rank)
        got[name] = _train_bn(pp.DDP(_bn_model(rank), world.group, **kwargs), rank)
        rep.close(f"{name}: parameters and buffers = torch's DDP", got[name], want, 1e-12)
    # Each rule changed what the ranks ended with (the comparison above is not one outcome four times).
    rules = [got[n] for n in list(CONFIGS)[:3]]
    rep.check(
        "the three buffer rules end differently on rank 1",
        rank == 0 or all(not np.allclose(a, b) for i, a in enumerate(rules) for b in rules[i + 1 :]),
    )


def _gpt2_steps(model: Any, rank: int | None, n: int) -> np.ndarray:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        batch = tm.global_batch("gpt2", step, n) if rank is None else tm.batch("gpt2", step, rank)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = model.state_dict()
    return np.concatenate([v.double().reshape(-1).numpy() for v in state.values()])


def mesh(world: Any, rep: Report) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import ShardingStrategy
    from torch.nn.parallel import DistributedDataParallel

    pp.init_torch_distributed(world)
    n, rank = world.world_size, world.rank
    flat = init_device_mesh("cpu", (n,))
    want = _gpt2_steps(tm.build("gpt2"), None, n)
    ddp = pp.DDP(tm.build("gpt2"), device_mesh=flat)
    rep.check("pp.DDP on a 1-D mesh runs over its group", ddp.group.size == n)
    got = _gpt2_steps(ddp, rank, n)
    theirs = _gpt2_steps(DistributedDataParallel(tm.build("gpt2"), device_mesh=flat), rank, n)
    rep.close("pp.DDP(device_mesh=1-D) = torch's DDP on the same mesh", got, theirs, 1e-12)
    rep.close("pp.DDP(device_mesh=1-D) = one process", got, want, 1e-9)
    fsdp = pp.FSDP(tm.build("gpt2"), device_mesh=flat)
    rep.check("pp.FSDP on a 1-D mesh shards over it", fsdp.shard_group.size == n)
    rep.close("pp.FSDP(device_mesh=1-D) = one process", _gpt2_steps(fsdp, rank, n), want, 1e-9)
    for shape in ((1, n), (n, 1)):
        grid = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        hsdp = pp.FSDP(tm.build("gpt2"), device_mesh=grid, sharding_strategy=ShardingStrategy.HYBRID_SHARD)
        rep.check(f"mesh {shape}: shard groups of the mesh's shard size", hsdp.shard_group.size == shape[1])
        rep.close(f"pp.FSDP(device_mesh={shape}, HYBRID_SHARD) = one process", _gpt2_steps(hsdp, rank, n), want,
                  1e-9)  # fmt: skip
    grid = init_device_mesh("cpu", (1, n))
    for what, call, words in (
        (
            "a group beside a mesh",
            lambda: pp.DDP(tm.build("gpt2"), world.group, device_mesh=flat),
            "not both",
        ),
        ("DDP on a 2-D mesh", lambda: pp.DDP(tm.build("gpt2"), device_mesh=grid), "1-D, as torch's"),
        ("full_shard on a 2-D mesh", lambda: pp.FSDP(tm.build("gpt2"), device_mesh=grid), "hybrid strategy"),
    ):
        try:
            call()
            rep.check(f"{what} is refused", False, "no error")
        except ValueError as e:
            rep.check(f"{what} is refused", words in str(e), str(e))


if __name__ == "__main__":
    run_rank({"buffers": buffers, "mesh": mesh}[sys.argv[1]])
