"""The tensor-parallel workers' check against the dense model: the same training on both, compared."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _common import Report


def train_against_dense(
    rep: Report,
    dense: Any,
    model: Any,
    opts: list[Any],
    losses: Callable[[int], tuple[Any, Any]],
    is_split: Callable[[str], bool],
    steps: int,
    tol: float,
) -> None:
    """``steps`` optimizer steps (``opts``: the dense model's, then the split one's) on ``losses(step)`` = (dense
    loss, split loss): every step's loss, the first step's gradients (each shard against its piece of the dense
    gradient; a parameter frozen in the dense model frozen alike; ``is_split`` names must be split) and the final
    parameters (``full_state_dict``) equal within ``tol``."""
    for step in range(steps):
        want, got = losses(step)
        want.backward()
        got.backward()
        rep.close(f"loss step {step}", got.item(), want.item(), tol)
        if step == 0:
            dense_params = dict(dense.named_parameters())
            for pname, p in model.named_parameters():
                g = dense_params[pname].grad
                if g is None:
                    rep.check(f"{pname} frozen alike", p.grad is None, pname)
                    continue
                spec = getattr(p, "tp_shard", None)
                if is_split(pname):
                    rep.check(f"{pname} split", spec is not None, pname)
                rep.close(f"grad {pname}", p.grad, spec.local_of(g) if spec else g, tol)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    full, plain = model.full_state_dict(), dense.state_dict()
    rep.check("full_state_dict keys", list(full) == list(plain), f"{list(full)[:3]}")
    for key, t in plain.items():
        rep.close(f"final {key}", full[key], t, tol)
