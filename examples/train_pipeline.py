"""Train an MLP on scikit-learn's digits as a 2-stage pipeline with the 1F1B schedule.

    paramplane launch --standalone -n 2 examples/train_pipeline.py --epochs 10

Rank 0 holds the first half of the model, rank 1 the second half and the loss. Each global
batch is split into microbatches; activations flow forward and gradients backward between the
stages with send/recv. With more ranks, build the groups from one mesh, e.g.
``mesh = pp.Mesh(world, dp=2, pp=2)`` and ``pp.Pipeline(stage, mesh.group("pp"), ..., dp_group=mesh.group("dp"))``.
"""

from __future__ import annotations

import argparse

import numpy as np
from train_ddp import load_data

import paramplane as pp
from paramplane.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from paramplane.optim import AdamW


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    args = parser.parse_args(argv)
    world = pp.init()
    try:
        if world.world_size != 2:
            raise SystemExit("this example runs on 2 ranks: paramplane launch --standalone -n 2 ...")
        mesh = pp.Mesh(world, pp=2)
        rng = np.random.default_rng(0)
        first = Sequential(Linear(64, 128, rng=rng), ReLU())
        second = Sequential(Linear(128, 128, rng=rng), ReLU(), Linear(128, 10, rng=rng))
        stage = first if mesh.coordinate("pp") == 0 else second
        pipe = pp.Pipeline(stage, mesh.group("pp"), args.schedule, args.microbatches, CrossEntropyLoss())
        opt = AdamW(stage.parameters(), lr=3e-3)
        x_train, y_train, x_test, y_test = load_data()
        usable = (
            len(x_train) // args.batch_size * args.batch_size
        )  # whole batches split into equal microbatches
        for epoch in range(args.epochs):
            order = np.random.default_rng(epoch).permutation(len(x_train))[:usable]
            losses = []
            for start in range(0, usable, args.batch_size):
                idx = order[start : start + args.batch_size]
                out = pipe.step(
                    x_train[idx] if pipe.is_first else None, y_train[idx] if pipe.is_last else None
                )
                opt.step()
                opt.zero_grad()
                if out is not None:
                    losses.extend(out)
            if pipe.is_last:
                print(
                    f"epoch {epoch + 1}/{args.epochs}: mean training loss {np.mean(losses):.4f}", flush=True
                )
        n = len(x_test) // args.microbatches * args.microbatches
        logits = pipe.eval_step(x_test[:n] if pipe.is_first else None)
        if logits is not None:
            print(f"test accuracy: {float((logits.argmax(axis=1) == y_test[:n]).mean()):.4f}", flush=True)
        if world.rank == 0:
            print(pipe.schedule_table(), flush=True)
    finally:
        world.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
