"""Train a 2-way tensor-parallel MLP on scikit-learn's digits: each rank holds half of every layer.

    paramplane launch --standalone -n 2 examples/train_tp.py --epochs 10

The hidden layer is a ColumnParallelLinear (each rank computes half of the hidden units)
followed by a RowParallelLinear (each rank multiplies its half; one all-reduce sums them).
Every rank sees every sample; the logits are identical on every rank. With more ranks,
build the groups from one mesh, e.g. ``pp.Mesh(world, dp=2, tp=2)`` and wrap the model in
``pp.DDP(model, mesh.group("dp"))``.
"""

from __future__ import annotations

import argparse

import numpy as np
from train_ddp import load_data

import paramplane as pp
from paramplane.nn import GELU, CrossEntropyLoss, Sequential
from paramplane.optim import AdamW


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args(argv)
    world = pp.init()
    try:
        tp = pp.Mesh(world, tp=world.world_size).group("tp")
        model = Sequential(
            pp.ColumnParallelLinear(64, args.hidden, tp, rng=0),
            GELU(),
            pp.RowParallelLinear(args.hidden, 10, tp, rng=1),
        )
        opt = AdamW(model.parameters(), lr=3e-3)
        crit = CrossEntropyLoss()
        x_train, y_train, x_test, y_test = load_data()
        for epoch in range(args.epochs):
            order = np.random.default_rng(epoch).permutation(len(x_train))
            total = 0.0
            for start in range(0, len(order), args.batch_size):
                idx = order[start : start + args.batch_size]
                total += float(crit.forward(model.forward(x_train[idx]), y_train[idx])) * len(idx)
                model.backward(crit.backward())
                opt.step()
                opt.zero_grad()
            if world.rank == 0:
                print(
                    f"epoch {epoch + 1}/{args.epochs}: mean training loss {total / len(order):.4f}",
                    flush=True,
                )
        accuracy = float((model.forward(x_test).argmax(axis=1) == y_test).mean())
        if world.rank == 0:
            print(f"test accuracy: {accuracy:.4f}", flush=True)
    finally:
        world.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
