"""``DDP.join()`` with uneven inputs: rank r trains ``STEPS[r]`` steps inside ``with ddp.join():``.

``uneven``: a small MLP and the same with a BatchNorm layer (buffers), AdamW, with
``divide_by_initial_world_size`` True and False: every rank ends with the parameters (and buffers) of torch's
DDP doing the same loop under its own ``join()`` over gloo (1e-12), and the MLP's equal one process that steps
on the batches of the ranks still training at each step (divided as the option says).

``throw``: ``throw_on_early_termination=True``: every rank raises at the first step after rank 0 ran out.
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

STEPS = (2, 4, 3)  # per rank (world 3)


def _model(seed: int, batchnorm: bool) -> Any:
    import torch

    torch.manual_seed(seed)
    layers = [torch.nn.Linear(5, 7)] + ([torch.nn.BatchNorm1d(7)] if batchnorm else []) + [torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(7, 3)).double()


def _xy(step: int, rank: int) -> tuple[Any, Any]:
    import torch

    rng = np.random.default_rng(100 * step + rank)
    return torch.from_numpy(rng.standard_normal((4, 5))), torch.from_numpy(rng.standard_normal((4, 3)))


def _train(wrapped: Any, model: Any, rank: int, **join: Any) -> None:
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with wrapped.join(**join):
        for step in range(STEPS[rank]):
            x, y = _xy(step, rank)
            torch.nn.functional.mse_loss(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


def _state(model: Any) -> np.ndarray:
    return np.concatenate([t.detach().double().reshape(-1).numpy() for t in model.state_dict().values()])


def uneven(world: Any, rep: Report) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    tm.init_gloo(world)
    n, rank = world.world_size, world.rank
    assert n == len(STEPS)
    for batchnorm in (False, True):
        for initial in (True, False):
            tag = f"{'bn' if batchnorm else 'mlp'} divide_by_initial={initial}"
            ours = _model(rank, batchnorm)  # different on every rank: the wrap broadcasts rank 0's
            _train(pp.DDP(ours, world.group), ours, rank, divide_by_initial_world_size=initial)
            theirs = _model(rank, batchnorm)
            _train(DistributedDataParallel(theirs), theirs, rank, divide_by_initial_world_size=initial)
            rep.close(f"{tag}: as torch's DDP join", _state(ours), _state(theirs), 1e-12)
            rep.digests[tag] = digest(_state(ours))
            if batchnorm:
                continue
            ref = _model(0, False)
            opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            for step in range(max(STEPS)):
                active = [r for r in range(n) if STEPS[r] > step]
                divisor = n if initial else len(active)
                loss = sum(
                    torch.nn.functional.mse_loss(ref(_xy(step, r)[0]), _xy(step, r)[1]) for r in active
                )
                (loss / divisor).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            rep.close(f"{tag}: as one process on the ranks still training", _state(ours), _state(ref), 1e-10)
    # the context is left cleanly: a plain step after it still synchronises
    model = _model(0, False)
    ddp = pp.DDP(model, world.group)
    with ddp.join():
        pass
    x, y = _xy(7, rank)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    grads = np.concatenate([p.grad.reshape(-1).numpy() for p in model.parameters()])
    rep.check(
        "a step after join() averages", digest(grads) == digest(world.group.broadcast(grads.copy(), src=0))
    )


def throw(world: Any, rep: Report) -> None:
    import torch

    rank = world.rank
    model = _model(0, False)
    ddp = pp.DDP(model, world.group)
    done = 0
    try:
        with ddp.join(throw_on_early_termination=True):
            for step in range(STEPS[rank]):
                x, y = _xy(step, rank)
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                done += 1
        rep.check("raised", False, "no error")
    except RuntimeError as e:
        rep.check("raised", "ran out of inputs" in str(e), str(e))
    rep.check("at the step after the first rank ran out", done == min(STEPS), f"{done} steps")


if __name__ == "__main__":
    run_rank({"uneven": uneven, "throw": throw}[sys.argv[1]])
