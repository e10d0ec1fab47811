"""Train a small torch CNN on scikit-learn's handwritten digits with pp.DDP: a torch DDP script, ported line by line.

    paramplane launch --standalone -n 2 examples/train_torch_ddp.py --epochs 3 --stop-after 2   # interrupted
    paramplane launch --standalone -n 2 examples/train_torch_ddp.py --epochs 3 --resume        # epoch 3

What changes against a torch DDP script: ``pp.init()`` instead of ``dist.init_process_group``, ``pp.DDP(model,
world.group)`` instead of ``DistributedDataParallel(model)``, the sampler told the world, the metric summed with
``world.group.all_reduce`` on the tensor itself, the checkpoint through ``pp.checkpoint`` with the optimizer keyed
by parameter name (``ddp.optim_state(opt)``). Everything else is the usual loop: ``DistributedSampler`` and
``DataLoader``, AdamW with a cosine schedule, clipping between ``backward()`` and ``step()`` (the gradients are
averaged when ``backward()`` returns), BatchNorm (rank 0's statistics before each forward, as torch's DDP),
optional bfloat16 autocast, evaluation in ``eval()`` mode. A run resumed from a checkpoint ends with the very
parameters of a run that never stopped (``--digest FILE`` writes their digest).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import paramplane as pp


def digits() -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8x8 digits (1,797 images) as float32 tensors in [0, 1], split 1,500 / 297."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.from_numpy((data.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(data.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(y)))
    x, y = x[order], y[order]
    return TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank builds the same model; pp.DDP broadcasts rank 0's anyway
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.BatchNorm2d(16),
        torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, stride=2),
        torch.nn.BatchNorm2d(32),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 10),
    )


def evaluate(ddp: pp.DDP, loader: DataLoader[Any], group: pp.ProcessGroup) -> float:
    """Accuracy over every rank's share of the test set (correct and total summed over the ranks)."""
    ddp.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            counts[0] += (ddp(x).argmax(1) == y).sum()
            counts[1] += len(y)
    group.all_reduce(counts, "sum")  # in place, zero-copy
    ddp.train()
    return float(counts[0] / counts[1])


def train(world: pp.World, args: argparse.Namespace) -> float:
    group = world.group
    train_set, test_set = digits()
    sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, num_replicas=world.world_size, rank=world.rank, shuffle=True, seed=0
    )
    loader = DataLoader(train_set, batch_size=args.batch_size // world.world_size, sampler=sampler)
    test_sampler: DistributedSampler[Any] = DistributedSampler(
        test_set, num_replicas=world.world_size, rank=world.rank, shuffle=False
    )
    test_loader = DataLoader(test_set, batch_size=64, sampler=test_sampler)

    ddp = pp.DDP(build_model(), group)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    state = {"model": ddp, "optim": ddp.optim_state(opt), "sched": sched, "epoch": 0}
    start = 0
    resume = pp.checkpoint.latest(args.checkpoint_dir) if args.resume else None
    if resume is not None:
        start = pp.checkpoint.load(state, resume, group)["epoch"]
    if world.rank == 0:
        print(f"pp.DDP on {group.size} ranks, " + (f"resumed from {resume}" if resume else "from scratch"))
    accuracy = evaluate(ddp, test_loader, group) if start >= args.epochs else 0.0
    for epoch in range(start, min(args.epochs, args.stop_after or args.epochs)):
        sampler.set_epoch(epoch)
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()  # every .grad is averaged over the ranks when this returns
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        accuracy = evaluate(ddp, test_loader, group)
        state["epoch"] = epoch + 1
        path = pp.checkpoint.save(state, args.checkpoint_dir / f"epoch_{epoch + 1:03d}", group, keep=2)
        if world.rank == 0:
            print(
                f"epoch {epoch + 1}/{args.epochs}: loss {float(loss.detach()):.4f} test accuracy {accuracy:.3f} ({path})"
            )
    if args.digest is not None and world.rank == 0:
        flat = np.concatenate([v.detach().double().reshape(-1).numpy() for v in ddp.state_dict().values()])
        args.digest.write_text(hashlib.sha256(flat.tobytes()).hexdigest() + "\n")
    return accuracy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="train up to this epoch (default 3)")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--bf16", action="store_true", help="forward under bfloat16 autocast")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("digits_ckpt"))
    parser.add_argument("--resume", action="store_true", help="go on from the newest checkpoint there")
    parser.add_argument(
        "--stop-after",
        type=int,
        default=0,
        help="stop after this epoch, as if interrupted (0: run to --epochs)",
    )
    parser.add_argument("--digest", type=Path, help="write a digest of the final parameters and buffers here")
    args = parser.parse_args(argv)
    if min(args.epochs, args.batch_size) < 1 or not args.lr > 0 or args.stop_after < 0:
        parser.error("--epochs, --batch-size and --lr must be positive, --stop-after not negative")
    newest = pp.checkpoint.latest(args.checkpoint_dir)
    if newest is not None and not args.resume:
        parser.error(
            f"{args.checkpoint_dir} holds checkpoints ({newest.name}): pass --resume, or another dir"
        )
    with pp.init() as world:
        if args.batch_size % world.world_size:
            raise SystemExit(f"--batch-size {args.batch_size} does not split over {world.world_size} ranks")
        accuracy = train(world, args)
        if world.rank == 0:
            print(f"final test accuracy {accuracy:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
