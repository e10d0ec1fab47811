"""pp.DDP's host buckets hand their buffers to the gradients (``gradient_as_bucket_view=False``, torch's
default): gradients are held once, yet behave exactly as torch DDP's separate ``.grad`` tensors.

Over five steps with several buckets, ``no_sync`` accumulation, ``zero_grad(set_to_none=True)`` and
``(set_to_none=False)``, and a step with no zero_grad at all (two synchronised backwards accumulating), every
rank's ``.grad`` when backward returns equals one process on the whole batch and torch's own DDP (gloo) on the
same data; gradients a user kept from an earlier step are never written by a later one; and after each
synchronised backward no bucket holds a buffer of its own beside the gradients.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, digest, run_rank
from dropin_ddp import _small, _xy

import paramplane as pp

# per step: (micro-batches, zero_grad before it: "none" = set_to_none, "zero" = in place, "" = keep)
STEPS = (
    (1, "none"),
    (2, "none"),  # the first micro-batch under no_sync
    (1, "zero"),
    (1, ""),  # accumulates onto the previous step's averaged gradients
    (2, "none"),
)


def storage(world: Any, rep: Report) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    tm.init_gloo(world)
    n, rank = world.world_size, world.rank
    model, ref = _small(seed=rank), _small(seed=0)
    ddp = pp.DDP(model, world.group, bucket_mb=0.0002)
    theirs = DistributedDataParallel(_small(seed=0))
    rep.check("several buckets", ddp.num_buckets >= 2, f"{ddp.num_buckets}")
    kept: list[tuple[list[Any], list[np.ndarray]]] = []
    for step, (micro, zero) in enumerate(STEPS):
        for m in (model, ref, theirs.module):
            if zero:
                m.zero_grad(set_to_none=zero == "none")
        for k in range(micro):
            for wrapper in (ddp, theirs):
                with wrapper.no_sync() if k < micro - 1 else contextlib.nullcontext():
                    x, y = _xy(10 * step + k, rank)
                    torch.nn.functional.mse_loss(wrapper(x), y).div(micro).backward()
            xs, ys = zip(*(_xy(10 * step + k, r) for r in range(n)))
            torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).div(micro).backward()
        got = tm.flat_grads(model)
        rep.equal(f"step {step}: grads equal one process", got, tm.flat_grads(ref), rtol=1e-10)
        rep.equal(f"step {step}: grads equal torch DDP", got, tm.flat_grads(theirs.module), rtol=1e-12)
        rep.check(
            f"step {step}: gradients held once (no bucket keeps a buffer)",
            all(b.storage is None for b in ddp._buckets),
        )
        for grads, values in kept:
            same = all(np.array_equal(g.numpy(), v) for g, v in zip(grads, values, strict=True))
            rep.check(f"step {step}: gradients kept from an earlier step are unchanged", same)
        if step + 1 < len(STEPS) and STEPS[step + 1][1] == "none":  # dropped next: nobody writes them after
            grads = [p.grad for p in model.parameters()]
            kept.append((grads, [g.numpy().copy() for g in grads]))
        # everything stays on the same trajectory: one SGD step everywhere
        with torch.no_grad():
            for m in (model, ref, theirs.module):
                for p in m.parameters():
                    p -= 0.3 * p.grad
    rep.digests["storage"] = digest(np.concatenate([p.detach().numpy().ravel() for p in model.parameters()]))
    ddp.remove_hooks()


if __name__ == "__main__":
    run_rank(storage)
