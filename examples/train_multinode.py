"""Multi-node training with FSDP hybrid_shard and sharded checkpoints (the docker compose demo runs this).

    paramplane launch -n 2 --coordinator coordinator:29400 --world-size 4 examples/train_multinode.py --ckpt /ckpt

Each host runs 2 ranks: parameters are sharded over the ranks of a host (shared memory) and
replicated across hosts (gRPC between hosts carries one all-reduce of each shard per step).
Every ``--save-every`` steps the job writes a sharded checkpoint to ``--ckpt`` (a volume every
host sees) and, when started again, resumes from the newest complete one. The data is a
synthetic classification task generated from a fixed seed, so every host can make it alone.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import paramplane as pp
from paramplane.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from paramplane.optim import AdamW


def make_data(n: int = 2048, features: int = 32, classes: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    centers = rng.standard_normal((classes, features)) * 2.0
    y = rng.integers(0, classes, n)
    x = (centers[y] + rng.standard_normal((n, features))).astype(np.float32)
    return x, y


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--ckpt", type=Path, default=Path("ckpt"), help="checkpoint folder every host sees")
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=64, help="width of the two hidden layers")
    parser.add_argument(
        "--log-every", type=int, default=0, help="rank 0 prints 'step N' this often (0: never)"
    )
    args = parser.parse_args(argv)
    if min(args.steps, args.save_every, args.hidden) < 1 or args.log_every < 0:
        parser.error("--steps, --save-every and --hidden must be >= 1, --log-every >= 0")
    world = pp.init()
    try:
        group = world.group
        rng = np.random.default_rng(0)
        model = Sequential(
            Linear(32, args.hidden, rng=rng),
            ReLU(),
            Linear(args.hidden, args.hidden, rng=rng),
            ReLU(),
            Linear(args.hidden, 4, rng=rng),
        )
        fsdp = pp.FSDP(model, group, strategy="hybrid_shard")  # shard inside a host, replicate across hosts
        opt = AdamW(fsdp.parameters(), lr=3e-3)
        fsdp.attach(opt)
        crit = CrossEntropyLoss(reduction="sum")
        start = 0
        resume = pp.checkpoint.latest(args.ckpt)
        if resume is not None:
            start = pp.checkpoint.load({"model": fsdp, "optim": opt, "step": 0}, resume, group)["step"]
            if world.rank == 0:
                print(f"resumed from {resume} at step {start}", flush=True)
        x, y = make_data()
        a, b = pp.shard_range(args.batch_size, group.size, group.rank)
        loss = np.zeros(1)
        step_s: list[float] = []  # steps without a checkpoint save
        for step in range(start, args.steps):
            began = time.perf_counter()
            idx = np.random.default_rng(step).choice(len(x), args.batch_size, replace=False)[a:b]
            loss[0] = float(crit.forward(fsdp(x[idx]), y[idx])) / args.batch_size
            fsdp.backward(crit.backward(grad_scale=group.size / args.batch_size))
            opt.step()
            opt.zero_grad()
            if (step + 1) % args.save_every != 0 and step + 1 != args.steps:
                step_s.append(time.perf_counter() - began)
            else:
                path = pp.checkpoint.save(
                    {"model": fsdp, "optim": opt, "step": step + 1},
                    args.ckpt / f"step_{step + 1}",
                    group,
                    keep=2,
                )
                if world.rank == 0:
                    print(f"checkpoint: {path}", flush=True)
            if world.rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
                print(f"step {step + 1} of epoch {world.epoch} job {world.job_id}", flush=True)
        plane = world.runtime.plane  # how this rank's frames to other hosts travelled (lane or gRPC stream)
        links = ",".join(sorted(plane.outbound_kinds())) or "-"
        print(f"transport: rank {world.rank} host {world.node_rank} frames {plane.frames_ride} links {links}")
        group.all_reduce(loss, "sum")
        fsdp.eval()
        logits = fsdp(x[a * 32 : b * 32])
        correct = np.array([int((logits.argmax(axis=1) == y[a * 32 : b * 32]).sum()), (b - a) * 32], np.int64)
        group.all_reduce(correct, "sum")
        if world.rank == 0:
            print(
                f"hosts {world.num_nodes}, ranks {world.world_size}, shard group {fsdp.shard_group.size}",
                flush=True,
            )
            print(f"final loss: {loss[0]:.4f}; accuracy: {correct[0] / correct[1]:.4f}", flush=True)
            if step_s:
                print(
                    f"step time: {np.median(step_s) * 1e3:.2f} ms median over {len(step_s)} steps", flush=True
                )
    finally:
        world.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
