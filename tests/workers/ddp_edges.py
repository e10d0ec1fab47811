"""Rank worker for tests/parallel/test_ddp.py (2 ranks).

``mismatch``: ranks that wrap different models with the same number of elements get a CollectiveMismatch
naming the parameter when DDP wraps them, before any training; different numbers of parameters likewise.
``sum_untouched``: with ``reduce_op="sum"`` and no zero_grad between synchronised rounds, a parameter that gets
no gradient in the second round keeps the first round's sum (not that sum once per rank), with and without
``gradient_as_bucket_view``.
``buffers``: a forward re-broadcasts rank 0's buffers only in training mode outside ``no_sync`` (as torch DDP);
many buffers of two dtypes (0-d and non-contiguous ones among them) take one broadcast per dtype (coalesced, as
torch's ``_broadcast_coalesced``), every one then rank 0's.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from _common import Report, run_rank

import paramplane as pp
from paramplane.nn import Linear, Module, Parameter
from paramplane.parallel.ddp_buckets import broadcast_arrays


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

    rng = np.random.default_rng(world.rank)
    floats = [rng.standard_normal(shape).astype(np.float32) for shape in [(), (3,), (4, 5)] * 10]
    counts = [np.array(rng.integers(0, 100)) for _ in range(10)]  # BatchNorm's num_batches_tracked: 0-d int64
    base = rng.standard_normal((4, 6))
    strided = base[:, ::2].T  # not contiguous: written through, the other columns kept
    kept = base[:, 1::2].copy()
    before = world.group._e.progress()[0]
    broadcast_arrays(world.group, [*floats, *counts, strided])
    issued = world.group._e.progress()[0] - before
    rep.check("one broadcast per dtype (float32, int64, float64)", issued == 3, f"{issued} broadcasts")
    want = np.random.default_rng(0)
    for k, a in enumerate(floats):
        rep.equal(f"float buffer {k} is rank 0's", a, want.standard_normal(a.shape).astype(np.float32))
    for k, a in enumerate(counts):
        rep.equal(f"count buffer {k} is rank 0's", a, np.array(want.integers(0, 100)))
    rep.equal("strided buffer is rank 0's", strided, want.standard_normal((4, 6))[:, ::2].T)
    rep.equal("the rest of its base is kept", base[:, 1::2], kept)


MODES = {"mismatch": mismatch, "sum_untouched": sum_untouched, "buffers": buffers}

if __name__ == "__main__":
    run_rank(MODES[sys.argv[1]])
