"""pp.DDP as a drop-in for torch's DistributedDataParallel, with the loop torch users already have.

``issue``: issue 25's items 1-2 on a small model: ``.grad`` is averaged when ``loss.backward()`` returns, so
``clip_grad_norm_`` between backward and step clips the averaged gradient and the step uses it.

``models``: for transformers GPT-2, Llama (tied embeddings, ``ModelOutput``) and ResNet (BatchNorm buffers),
``out = ddp(**batch)``, ``out.loss.backward()``, ``clip_grad_norm_`` (really clipping), AdamW with a decay
and a no-decay group and an LR scheduler, ``zero_grad(set_to_none=True)``; every step's losses and the final
parameters equal one process on the whole batch and torch's own DDP over gloo. Then ``no_sync``
accumulation, a submodule unused on every rank and on one rank, a call with positional and keyword
arguments, and bfloat16 autocast on a float32 model, against one process and torch's DDP.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _torch_models as tm
from _common import Report, digest, run_rank

import paramplane as pp

STEPS = 3
CLIP = 0.05  # far below every model's gradient norm here: clipping happens in every step (checked)
BUCKET_MB = 0.002  # several buckets, so all-reduces start while backward runs


def _close(rep: Report, name: str, got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    """``max|got - want| <= rtol * max|want|`` (elementwise relative error is meaningless for entries that
    are zero in exact arithmetic, such as attention key biases, which AdamW moves by rounding noise)."""
    err = float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-300)
    rep.check(name, err <= rtol, f"relative error {err:.3g} > {rtol:g}")


def _grads(params: Any) -> np.ndarray:
    return np.concatenate(
        [p.grad.detach().double().reshape(-1).numpy() for p in params if p.grad is not None]
    )


# -- issue 25 items 1-2 ---------------------------------------------------------------------------------
def _small(seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def _xy(step: int, rank: int) -> tuple[Any, Any]:
    import torch

    rng = np.random.default_rng(step * 100 + rank)
    return torch.from_numpy(rng.standard_normal((4, 5))), torch.from_numpy(rng.standard_normal((4, 3)))


def issue(world: Any, rep: Report) -> None:
    import torch

    n = world.world_size
    model = _small(seed=world.rank)
    ddp = pp.DDP(model, world.group, bucket_mb=0.0002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    ddp.attach(opt)  # still accepted (a no-op wait now); the sync must not depend on it
    ref = _small(seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for step in range(STEPS):
        x, y = _xy(step, world.rank)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        xs, ys = zip(*(_xy(step, r) for r in range(n)))
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        rep.equal(f"step {step}: grads averaged when backward returns", _grads(model.parameters()),
                  _grads(ref.parameters()), rtol=1e-10)  # fmt: skip
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        rep.check(f"step {step}: clipping happens", float(norm) > 2 * CLIP, f"norm {float(norm)}")
        rep.equal(f"step {step}: global norm", norm.numpy(), ref_norm.numpy(), rtol=1e-10)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        rep.equal(f"step {step}: clipped step equals one process", tm.flat_params(model), tm.flat_params(ref),
                  rtol=1e-10)  # fmt: skip
    rep.digests["issue"] = digest(tm.flat_params(model))


MODES: dict[str, Callable[[Any, Report], None]] = {"issue": issue}

if __name__ == "__main__":
    run_rank(MODES[sys.argv[1]])
