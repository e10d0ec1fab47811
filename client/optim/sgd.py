"""Stochastic gradient descent with torch.optim.SGD's update rule."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from paramplane.nn.module import Array, Parameter
from paramplane.optim.optimizer import Optimizer


class SGD(Optimizer):
    """torch.optim.SGD semantics, per parameter ``p`` with gradient ``g``::

        g = g + weight_decay * p
        if momentum:
            buf = g (first step) else momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p -= lr * g

    State: ``state[i]["momentum_buffer"]`` (only when momentum is non-zero).
    """

    HYPERPARAMS: ClassVar[tuple[str, ...]] = ("lr", "momentum", "weight_decay", "nesterov", "dampening")

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        dampening: float = 0.0,
    ) -> None:
        super().__init__(params)
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.nesterov = nesterov
        self.dampening = dampening
        self._validate()

    def _validate(self) -> None:
        if not self.lr >= 0.0:
            raise ValueError(f"SGD: invalid learning rate {self.lr!r} (must be >= 0)")
        if not self.momentum >= 0.0:
            raise ValueError(f"SGD: invalid momentum {self.momentum!r} (must be >= 0)")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"SGD: invalid weight_decay {self.weight_decay!r} (must be >= 0)")
        if not 0.0 <= self.dampening <= 1.0:
            raise ValueError(f"SGD: invalid dampening {self.dampening!r} (must lie in [0, 1])")
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            raise ValueError("SGD: nesterov momentum needs momentum > 0 and dampening == 0")

    def _update(self, index: int, param: Parameter, grad: Array) -> None:
        g = grad
        if self.weight_decay != 0.0:
            g = g + self.weight_decay * param.data
        if self.momentum != 0.0:
            state = self.state.setdefault(index, {})
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = g.copy()
            else:
                buf *= self.momentum
                buf += (1.0 - self.dampening) * g
            g = g + self.momentum * buf if self.nesterov else buf
        param.data -= self.lr * g
