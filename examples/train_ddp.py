"""Train an MLP on scikit-learn's handwritten digits with DDP, each rank on its shard of every batch.

    paramplane launch --standalone -n 4 examples/train_ddp.py --epochs 20 --out demo_out

Every rank builds the model (DDP broadcasts rank 0's initial weights), walks the
same shuffled order of the training set and takes its ``numpy.array_split`` share of
each global batch. Shards may be uneven (any world size, a short last batch), so the
loss is a per-shard *sum* scaled by ``1 / global_batch`` and DDP sums the gradients:
N ranks compute exactly what one process computes on the whole batch. Rank 0 shows
a progress bar, prints the test accuracy and saves the loss curve as a PNG.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

import paramplane as pp
from paramplane.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from paramplane.optim import AdamW
from paramplane.parallel.ddp import DDP, shard_range


def load_data(seed: int = 0, test_fraction: float = 0.2) -> tuple[np.ndarray, ...]:
    """Digits (8x8 images, 10 classes; shipped with scikit-learn) scaled to [0, 1]: x_train, y_train, x_test, y_test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    num_test = int(len(x) * test_fraction)
    test, train = order[:num_test], order[num_test:]
    return x[train], y[train], x[test], y[test]


def build_model(seed: int = 0, hidden: int = 128, xp: ModuleType = np) -> Sequential:
    """The MLP, its parameters on ``xp`` (numpy, or cupy for the current GPU)."""
    rng = np.random.default_rng(seed)
    return Sequential(
        Linear(64, hidden, rng=rng, xp=xp),
        ReLU(),
        Linear(hidden, hidden, rng=rng, xp=xp),
        ReLU(),
        Linear(hidden, 10, rng=rng, xp=xp),
    )


def evaluate(model: Any, group: pp.ProcessGroup, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy over the whole set: each rank scores its shard, one all-reduce adds the counts."""
    a, b = shard_range(len(x), group.size, group.rank)
    correct = np.array([int((model.forward(x[a:b]).argmax(axis=1) == y[a:b]).sum())], np.int64)
    group.all_reduce(correct, op="sum")
    return int(correct[0]) / len(x)


def train(
    world: pp.World,
    epochs: int = 20,
    batch_size: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Train with DDP on ``world.group``; returns the per-step global losses and the test accuracy."""
    group = world.group
    if batch_size < group.size:
        raise ValueError(f"batch_size {batch_size} is smaller than the world ({group.size} ranks)")
    x_train, y_train, x_test, y_test = load_data(seed)
    model = DDP(build_model(seed + world.rank), group, reduce_op="sum")  # rank 0's weights win
    optimizer = AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    model.attach(optimizer)  # optimizer.step() waits for the gradient all-reduces
    crit = CrossEntropyLoss(reduction="sum")
    starts = [s for s in range(0, len(x_train), batch_size) if len(x_train) - s >= group.size]
    losses: list[float] = []
    for epoch in range(epochs):
        order = np.random.default_rng(seed * 1000 + epoch).permutation(len(x_train))  # same on all ranks
        local = np.zeros(len(starts))
        steps: Any = range(len(starts))
        if progress and world.rank == 0:
            from tqdm import tqdm

            steps = tqdm(steps, desc=f"epoch {epoch + 1}/{epochs}", unit="step", leave=True)
        for n in steps:
            batch = order[starts[n] : starts[n] + batch_size]
            a, b = shard_range(len(batch), group.size, group.rank)
            mine = batch[a:b]
            optimizer.zero_grad()
            local[n] = float(crit.forward(model.forward(x_train[mine]), y_train[mine]))
            model.backward(crit.backward(grad_scale=1.0 / len(batch)))
            optimizer.step()
        group.all_reduce(local, op="sum")  # one collective per epoch for the loss curve
        sizes = np.array([min(batch_size, len(x_train) - s) for s in starts])
        losses.extend((local / sizes).tolist())
        if progress and world.rank == 0 and hasattr(steps, "set_postfix"):
            steps.set_postfix(loss=f"{losses[-1]:.4f}")
            steps.close()
    model.eval()
    accuracy = evaluate(model, group, x_test, y_test)
    return {"losses": losses, "accuracy": accuracy, "steps_per_epoch": len(starts)}


def save_loss_plot(losses: list[float], steps_per_epoch: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(1, len(losses) + 1) / steps_per_epoch, losses)
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (global batch mean)")
    ax.set_yscale("log")
    ax.set_title("paramplane DDP on digits")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=128, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="folder for loss.png")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    world = pp.init()  # PARAMPLANE_COORDINATOR etc. come from `paramplane launch`
    try:
        result = train(world, args.epochs, args.batch_size, args.lr, progress=not args.no_progress)
        if world.rank == 0:
            png = save_loss_plot(result["losses"], result["steps_per_epoch"], args.out / "loss.png")
            print(f"test accuracy: {result['accuracy']:.4f}", flush=True)
            print(f"loss curve: {png}", flush=True)
        world.group.barrier()
    finally:
        world.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
