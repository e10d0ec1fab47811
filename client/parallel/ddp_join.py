"""``DDP.join()``: training with uneven inputs (ranks with different numbers of batches), as torch's
``DistributedDataParallel.join()`` with its ``Join`` context.

Inside ``with ddp.join():`` every forward first all-gathers one small row per rank (is it still training,
will this step's backward synchronise, does this forward take the buffers): a rank whose loop has ended
answers these rounds from the context's exit instead, and shadows each step of the others: the buffer
broadcast when they take one, and the gradient all-reduces with zero gradients (its bucket slots flagged
"no gradient"), so the collectives pair up and nothing waits for it. By default the average still divides by
the initial world size (torch's ``divide_by_initial_world_size=True``: a joined rank counts as zeros); with
False it divides by the ranks still training. Buffers are broadcast from the highest rank still training
(its statistics are current, as torch picks). When every rank has joined, the parameters and buffers of the
rank that trained the most steps are broadcast to all (the others' optimizers did not step meanwhile, as
with torch; their optimizer state is theirs). ``throw_on_early_termination=True`` makes every rank raise at
the first step after one ran out of inputs instead.

Each forward with grad enabled inside the context must be followed by its backward (the joined ranks shadow
one synchronised backward per such forward), as with torch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from paramplane.parallel.ddp import DDP

__all__ = ["JoinState", "Round", "joined_rounds"]


@dataclass
class Round:
    """What the ranks said in one join round."""

    num_active: int
    """Ranks still training."""
    num_syncing: int
    """Ranks whose forward's backward synchronises its gradients."""
    buffers_from: int | None
    """The group rank to broadcast buffers from this forward (the highest training one that takes them)."""


@dataclass
class JoinState:
    """One ``join()`` context of a DDP."""

    divide_by_initial_world_size: bool
    throw_on_early_termination: bool
    num_steps: int = 0
    """Rounds this rank took part in while training."""

    def round(self, ddp: DDP, row: tuple[int, int, int]) -> Round:
        """All-gather this rank's (training, syncs, takes buffers) and read the group's answer."""
        rows = np.asarray(ddp.group.all_gather(np.array(row, np.int64))).reshape(-1, 3)
        active = rows[:, 0] > 0
        num_active, num_syncing = int(active.sum()), int(rows[:, 1].sum())
        takers = np.flatnonzero(active & (rows[:, 2] > 0))
        out = Round(num_active, num_syncing, int(takers[-1]) if takers.size else None)
        if self.throw_on_early_termination and num_active < ddp.group.size:
            raise RuntimeError(
                f"DDP.join(throw_on_early_termination=True): {ddp.group.size - num_active} rank(s) ran out of "
                "inputs"
            )
        if 0 < num_syncing < num_active:
            raise RuntimeError(
                f"DDP.join: {num_syncing} of {num_active} training ranks synchronise this step's gradients "
                "(no_sync or torch.no_grad on the others): every training rank must do the same"
            )
        return out

    def mean_over(self, ddp: DDP, r: Round) -> int:
        """What this step's mean divides by."""
        return ddp.group.size if self.divide_by_initial_world_size else max(1, r.num_active)

    def shadow(self, ddp: DDP, r: Round) -> None:
        """A joined rank's part of one training step of the others: their buffer broadcast and, when they
        synchronise, the all-reduce of every bucket with no gradient of its own."""
        if r.buffers_from is not None:
            ddp._broadcast_buffers(src=r.buffers_from)
        if r.num_syncing == 0:
            return
        for t in ddp.module.parameters():
            t.grad = None
        ddp._mean_over = self.mean_over(ddp, r)
        ddp._round_open = True
        ddp.finish_gradient_sync()
        for t in ddp.module.parameters():
            t.grad = None

    def finish(self, ddp: DDP) -> None:
        """Every rank has joined: take the parameters and buffers of the rank that trained longest."""
        steps = np.asarray(ddp.group.all_gather(np.array([self.num_steps], np.int64))).reshape(-1)
        src = int(np.argmax(steps))
        ddp._sync_state(ddp._path.params(), src=src, buffers=ddp.broadcast_buffers)
        for t in ddp.module.parameters():
            t.grad = None


def joined_rounds(ddp: DDP, state: JoinState) -> None:
    """This rank's loop has ended: answer and shadow the others' rounds until every rank has joined."""
    while True:
        r = state.round(ddp, (0, 0, 0))
        if r.num_active == 0:
            break
        state.shadow(ddp, r)
    state.finish(ddp)
    ddp._mean_over = ddp.group.size
