"""Adam with decoupled weight decay, with torch.optim.AdamW's update rule."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar

from paramplane.nn.module import Array, Parameter
from paramplane.node.arrays import array_module
from paramplane.optim.optimizer import Optimizer


class AdamW(Optimizer):
    """torch.optim.AdamW semantics, per parameter ``p`` with gradient ``g`` at step ``t`` (from 1)::

        p *= 1 - lr * weight_decay
        m += (1 - beta1) * (g - m)                 # torch's lerp
        v = beta2 * v + (1 - beta2) * g * g
        v_hat = max(v_max, v) if amsgrad else v    # v_max kept in state
        p -= (lr / (1 - beta1**t)) * m / (sqrt(v_hat) / sqrt(1 - beta2**t) + eps)

    State: ``step`` (int), ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad).
    """

    HYPERPARAMS: ClassVar[tuple[str, ...]] = ("lr", "betas", "eps", "weight_decay", "amsgrad")

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
    ) -> None:
        super().__init__(params)
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.amsgrad = amsgrad
        self._validate()

    def _validate(self) -> None:
        if not self.lr >= 0.0:
            raise ValueError(f"AdamW: invalid learning rate {self.lr!r} (must be >= 0)")
        if not self.eps >= 0.0:
            raise ValueError(f"AdamW: invalid eps {self.eps!r} (must be >= 0)")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"AdamW: invalid weight_decay {self.weight_decay!r} (must be >= 0)")
        betas = tuple(self.betas)
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW: invalid betas {self.betas!r} (two values in [0, 1))")
        self.betas = (float(betas[0]), float(betas[1]))

    def _update(self, index: int, param: Parameter, grad: Array) -> None:
        beta1, beta2 = self.betas
        xp = array_module(param.data)
        state = self.state.get(index)
        if state is None:
            state = self.state[index] = {
                "step": 0,
                "exp_avg": xp.zeros_like(param.data),
                "exp_avg_sq": xp.zeros_like(param.data),
            }
        state["step"] += 1
        step = state["step"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]

        param.data *= 1.0 - self.lr * self.weight_decay
        exp_avg += (1.0 - beta1) * (grad - exp_avg)
        exp_avg_sq *= beta2
        exp_avg_sq += (1.0 - beta2) * (grad * grad)
        if self.amsgrad:
            # Created here too, for state saved before amsgrad was switched on.
            second = state.setdefault("max_exp_avg_sq", xp.zeros_like(param.data))
            xp.maximum(second, exp_avg_sq, out=second)
        else:
            second = exp_avg_sq
        step_size = self.lr / (1.0 - beta1**step)
        denom = xp.sqrt(second) / math.sqrt(1.0 - beta2**step) + self.eps
        param.data -= step_size * exp_avg / denom
