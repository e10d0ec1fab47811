"""DiLoCo across two hosts: FSDP inside each host, replicas synced every H steps across them.

    paramplane demo --diloco                                  # 2 emulated hosts x 2 ranks on this machine
    paramplane launch -n 2 --coordinator HOST:PORT --world-size 4 examples/train_diloco.py   # on each host

Each host's ranks shard one replica of an MLP (``pp.FSDP`` full_shard over ``mesh.group("shard")``: shared
memory); the replicas train alone with AdamW and every ``--sync-every`` steps ``pp.DiLoCo`` averages what
they learnt across the hosts (``mesh.group("replicate")``) with Nesterov SGD as the outer optimizer. With
``--fragments 4 --overlap --outer-dtype int8`` it is Streaming DiLoCo. The data is a synthetic
classification task from a fixed seed; each rank draws its own batches. Rank 0 prints the loss at every
sync and what crossed between the hosts compared with HybridShard's all-reduce every step.
"""

from __future__ import annotations

import argparse

import numpy as np

import paramplane as pp
from paramplane.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from paramplane.optim import AdamW


def make_data(n: int = 4096, features: int = 32, classes: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1234)
    centers = rng.standard_normal((classes, features)) * 0.35
    y = rng.integers(0, classes, n)
    return (centers[y] + rng.standard_normal((n, features))).astype(np.float32), y


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sync-every", type=int, default=20, help="H: inner steps between syncs")
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--outer-dtype", choices=("bfloat16", "float16", "int8"), default=None)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args(argv)
    world = pp.init()
    try:
        per_host = world.local_world_size
        if world.world_size % per_host or world.world_size // per_host < 2:
            raise SystemExit("train_diloco.py needs at least 2 hosts with the same number of ranks")
        mesh = pp.Mesh(world, dims=[("replicate", world.world_size // per_host), ("shard", per_host)])
        rng = np.random.default_rng(0)
        model = Sequential(
            Linear(32, 128, rng=rng), ReLU(), Linear(128, 128, rng=rng), ReLU(), Linear(128, 8, rng=rng)
        )
        fsdp = pp.FSDP(model, mesh.group("shard"), "full_shard")
        opt = AdamW(fsdp.parameters(), lr=3e-3)
        fsdp.attach(opt)
        diloco = pp.DiLoCo(
            fsdp,
            opt,
            mesh.group("replicate"),
            sync_every=args.sync_every,
            fragments=args.fragments,
            overlap=args.overlap,
            outer_dtype=args.outer_dtype,
        )
        if world.rank == 0:
            print(f"{world.num_nodes} hosts x {per_host} ranks; {diloco}", flush=True)
        x, y = make_data()
        crit = CrossEntropyLoss()
        rng = np.random.default_rng(100 + world.rank)
        loss = np.zeros(1)
        for step in range(args.steps):
            idx = rng.integers(0, len(x), args.batch_size)
            loss[0] = float(crit.forward(fsdp.forward(x[idx]), y[idx]))
            fsdp.backward(crit.backward())
            opt.step()  # DiLoCo syncs after every H-th inner step (its post-step hook)
            opt.zero_grad()
            if (step + 1) % diloco.interval == 0:
                world.group.all_reduce(loss, op="mean")
                if world.rank == 0:
                    print(f"step {step + 1}: loss {loss[0]:.4f} (mean over the ranks; synced)", flush=True)
        diloco.finish()
        num = sum(int(p.size) for p in fsdp.parameters())  # this rank's shard
        wire = {None: 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0 + 4 / 256}[args.outer_dtype]
        if world.rank == 0:
            print(
                f"across hosts each rank sent ~{num * wire * args.steps / args.sync_every / 1e3:.0f} kB of "
                f"outer gradients in {args.steps} steps; HybridShard's all-reduce every step: "
                f"~{num * 4 * args.steps / 1e3:.0f} kB",
                flush=True,
            )
        world.group.barrier()
    finally:
        world.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
