"""Rank worker for tests/parallel/test_ddp.py (2 ranks).

``mismatch``: ranks that wrap different models with the same number of elements get a CollectiveMismatch
naming the parameter when DDP wraps them, before any training; different numbers of parameters likewise.
``sum_untouched``: with ``reduce_op="sum"`` and no zero_grad between synchronised rounds, a parameter that gets
no gradient in the second round keeps the first round's sum (not that sum once per rank), with and without
``gradient_as_bucket_view``.
``buffers``: a forward re-broadcasts rank 0's buffers only in training mode outside ``no_sync`` (as torch DDP).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from _common import Report, run_rank

import paramplane as pp
from paramplane.nn import Linear, Module, Parameter


def mismatch(world: Any, rep: Report) -> None:
    model = Linear(6, 2, bias=False, rng=0) if world.rank == 0 else Linear(4, 3, bias=False, rng=0)
    rep.raises(
        "different models", pp.CollectiveMismatch, lambda: pp.DDP(model, world.group), "'weight'", "DDP"
    )
    other = Linear(6, 2, bias=world.rank == 0, rng=0)
    rep.raises(
        "different counts", pp.CollectiveMismatch, lambda: pp.DDP(other, world.group), "DDP: ranks wrap"
    )


class Two(Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Parameter(np.zeros(3))
        self.b = Parameter(np.zeros(3))


def sum_untouched(world: Any, rep: Report) -> None:
    for as_view in (False, True):  # gradient_as_bucket_view: the kept sum lives in the bucket itself
        m = Two()
        ddp = pp.DDP(m, world.group, reduce_op="sum", gradient_as_bucket_view=as_view)
        m.a.accumulate_grad(np.ones(3))
        m.b.accumulate_grad(np.ones(3))
        ddp.finish_gradient_sync()
        m.a.accumulate_grad(np.ones(3))  # b gets nothing this round
        ddp.finish_gradient_sync()
        n, how = world.world_size, " (as bucket views)" if as_view else ""
        rep.equal(f"touched twice{how}", m.a.grad, np.full(3, 2.0 * n))
        rep.equal(f"touched once, then kept{how}", m.b.grad, np.full(3, 1.0 * n))
        ddp.remove_hooks()


class WithBuffer(Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = Parameter(np.ones(3))
        self.register_buffer("stat", np.zeros(3))

    def forward(self, x: Any) -> Any:
        return x * self.w.data


def buffers(world: Any, rep: Report) -> None:
    m = WithBuffer()
    ddp = pp.DDP(m, world.group)
    mine = float(10 + world.rank)
    m.stat[...] = mine
    with ddp.no_sync():
        ddp.forward(np.ones(3))
    rep.equal("no_sync forward leaves the buffers", m.stat, np.full(3, mine))
    m.eval()
    ddp.forward(np.ones(3))
    rep.equal("eval forward leaves the buffers", m.stat, np.full(3, mine))
    m.train()
    ddp.forward(np.ones(3))
    rep.equal("training forward takes rank 0's buffers", m.stat, np.full(3, 10.0))


MODES = {"mismatch": mismatch, "sum_untouched": sum_untouched, "buffers": buffers}

if __name__ == "__main__":
    run_rank(MODES[sys.argv[1]])
