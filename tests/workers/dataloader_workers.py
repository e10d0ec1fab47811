"""torch's DataLoader with worker processes inside a rank (transformers' GPT-2 under pp.DDP, world 2).

``fork``: 6 epochs, each forking 2 workers per rank (a ``DistributedSampler`` told the world), while the rank's
gRPC threads run: the workers used to segfault right after the fork (gRPC's fork handlers; grpc/grpc#32992). Every
step's loss and the final parameters equal one process on both ranks' batches.

``spawn``: this script has no ``if __name__ == "__main__":`` guard around ``pp.init()`` (as many users' scripts),
so a worker started with "spawn" runs it again: its ``pp.init()`` is refused with a RendezvousError naming the
guard (the traceback is in the rank's output) instead of trying to join as its parent's rank; the DataLoader
raises, and the world is intact (a collective after it).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, digest, run_rank

import paramplane as pp

EPOCHS = 6
SAMPLES = 8  # 2 batches of 2 per rank and epoch


def _dataset() -> Any:
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randint(0, 50, (SAMPLES, tm.SEQ), generator=g))


def _loader(world: Any, epoch: int, context: str, workers: int) -> Any:
    from torch.utils.data import DataLoader, DistributedSampler

    ds = _dataset()
    sampler = DistributedSampler(ds, num_replicas=world.world_size, rank=world.rank, seed=3)
    sampler.set_epoch(epoch)
    return DataLoader(ds, batch_size=2, sampler=sampler, num_workers=workers, multiprocessing_context=context)


def fork(world: Any, rep: Report) -> None:
    import torch

    model = pp.DDP(tm.build("gpt2", seed=0), world.group)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = tm.build("gpt2", seed=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses = [], []
    for epoch in range(EPOCHS):
        for (x,) in _loader(world, epoch, "fork", 2):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
            # one process on every rank's batch of this step (equal sizes: the mean of the ranks' losses)
            both = world.group.all_gather(x.numpy())
            whole = torch.from_numpy(both.reshape(-1, x.shape[1]))
            with torch.no_grad():
                ref_losses.append(float(ref(input_ids=x, labels=x).loss))
            ref(input_ids=whole, labels=whole).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    rep.check(
        "every epoch's batches", len(losses) == EPOCHS * SAMPLES // (2 * world.world_size), str(len(losses))
    )
    rep.close("every step's loss", np.array(losses), np.array(ref_losses), 1e-9)
    rep.close("parameters after the epochs", tm.flat_params(model.module), tm.flat_params(ref), 1e-9)
    rep.digests["params"] = digest(tm.flat_params(model.module))


def spawn(world: Any, rep: Report) -> None:
    try:
        for _ in _loader(world, 0, "spawn", 1):
            pass
        rep.check("the spawned worker's pp.init() is refused", False, "the loader ran")
    except RuntimeError as e:  # the DataLoader's: its worker exited
        rep.check("the spawned worker's pp.init() is refused", "exited unexpectedly" in str(e), str(e))
    total = world.group.all_reduce(np.array([1.0]))
    rep.check("the world is intact", float(total[0]) == world.world_size, str(total))


if sys.argv[1:] == ["spawn"]:  # no main guard, as a user's script: a spawned worker runs this again
    if __name__ == "__mp_main__":
        pp.init()
    else:
        run_rank(spawn)
elif __name__ == "__main__":
    run_rank(fork)
