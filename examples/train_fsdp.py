"""Train an MLP on scikit-learn's digits with FSDP (full_shard by default): each rank holds a quarter.

    paramplane launch --standalone -n 4 examples/train_fsdp.py --epochs 10
    paramplane launch --standalone -n 2 examples/train_fsdp.py --device cuda   # cupy + NCCL

With ``--device cuda`` each rank takes a GPU (``world.use_gpu()``; ranks share one where the
host has fewer GPUs than ranks) and the model, data and collectives live there.

Every rank builds the model; FSDP broadcasts rank 0's initial weights, keeps only this
rank's shard of every layer between uses, and gathers a layer just for its forward and
backward. The optimizer steps the shards, so its state is sharded too. Each rank takes
its ``numpy.array_split`` share of every global batch; the loss is a per-shard sum scaled
by ``world_size / global_batch``, and FSDP averages gradients over the ranks, so N ranks
compute what one process computes on the whole batch. Rank 0 prints the test accuracy;
every rank prints its measured memory beside the analytic estimate.
"""

from __future__ import annotations

import argparse
import json
from types import ModuleType
from typing import Any

import numpy as np
from train_ddp import build_model, evaluate, load_data

import paramplane as pp
from paramplane.nn import CrossEntropyLoss
from paramplane.optim import AdamW
from paramplane.parallel.ddp import shard_range


def train(
    world: pp.World,
    epochs: int,
    batch_size: int,
    lr: float,
    strategy: str,
    seed: int = 0,
    xp: ModuleType = np,
) -> dict[str, Any]:
    group = world.group
    x_train, y_train, x_test, y_test = (xp.asarray(a) for a in load_data(seed))
    model = pp.FSDP(build_model(seed + world.rank, hidden=256, xp=xp), group, strategy=strategy)
    optimizer = AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    model.attach(optimizer)
    crit = CrossEntropyLoss(reduction="sum")
    starts = [s for s in range(0, len(x_train), batch_size) if len(x_train) - s >= group.size]
    losses = []
    for epoch in range(epochs):
        order = xp.asarray(np.random.default_rng(seed * 1000 + epoch).permutation(len(x_train)))
        total = np.zeros(1)
        for start in starts:
            batch = order[start : start + batch_size]
            a, b = shard_range(len(batch), group.size, group.rank)
            mine = batch[a:b]
            total[0] += float(crit.forward(model(x_train[mine]), y_train[mine])) / len(batch)
            model.backward(crit.backward(grad_scale=group.size / len(batch)))
            optimizer.step()
            optimizer.zero_grad()
        group.all_reduce(total, "sum")
        losses.append(float(total[0]) / len(starts))
        if world.rank == 0:
            print(f"epoch {epoch + 1}/{epochs}: mean training loss {losses[-1]:.4f}", flush=True)
    model.eval()
    return {
        "losses": losses,
        "accuracy": evaluate(model, group, x_test, y_test),
        "memory": model.memory_stats(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--strategy", default="full_shard", help="FSDP sharding strategy")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: cupy arrays, NCCL")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    world = pp.init()
    try:
        xp: ModuleType = np
        if args.device == "cuda":
            import cupy

            print(f"rank {world.rank} on GPU {world.use_gpu()}", flush=True)
            xp = cupy
        result = train(world, args.epochs, args.batch_size, args.lr, args.strategy, xp=xp)
        mem = result["memory"]
        line = {
            k: mem[k]["peak"] for k in ("params_sharded", "params_gathered", "grads", "optim_state", "total")
        }
        est = mem["estimate"]
        estimate = est["param_memory_bytes"] + est["grad_memory_bytes"] + est["optim_memory_bytes"]
        print(f"rank {world.rank} memory peak bytes {json.dumps(line)}; estimate {estimate}", flush=True)
        if world.rank == 0:
            print(f"test accuracy: {result['accuracy']:.4f}", flush=True)
        world.group.barrier()
    finally:
        world.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
