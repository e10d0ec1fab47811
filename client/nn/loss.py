"""Losses with explicit backward: MSELoss and CrossEntropyLoss.

``loss = crit.forward(pred, target)`` returns a 0-d array of ``pred``'s array
module (numpy or cupy; ``float(loss)`` gives a Python number, which on cupy
waits for the device). ``grad = crit.backward(grad_scale=1.0)`` returns
``grad_scale * d loss / d pred`` with ``pred``'s shape and dtype.

Reductions: ``"sum"`` is the exact sum over the local batch. ``"mean"``
divides by the local count (CrossEntropy: the number of targets, i.e. the
batch size; MSE: the number of elements, as in torch). Under DDP, which
averages gradients over ranks, equal per-rank batches therefore give the
global mean; for uneven splits use ``"sum"`` with
``grad_scale = 1 / global_count``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paramplane.nn.module import Array
from paramplane.node.arrays import array_module

_REDUCTIONS = ("mean", "sum")


class Loss:
    """Base class: ``forward(pred, target)`` caches what ``backward`` needs; ``backward`` consumes it."""

    def __init__(self, reduction: str = "mean") -> None:
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction
        self._saved: dict[str, Any] | None = None

    def forward(self, pred: Array, target: Array) -> Array:
        raise NotImplementedError

    def __call__(self, pred: Array, target: Array) -> Array:
        return self.forward(pred, target)

    def backward(self, grad_scale: float = 1.0) -> Array:
        raise NotImplementedError

    def _take_saved(self) -> dict[str, Any]:
        if self._saved is None:
            raise RuntimeError(
                f"{type(self).__name__}.backward() called without a forward() since the last one"
            )
        saved, self._saved = self._saved, None
        return saved

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reduction={self.reduction!r})"


class MSELoss(Loss):
    """``sum((pred - target)**2)``, divided by ``pred.size`` for ``"mean"``; shapes must match exactly."""

    def forward(self, pred: Array, target: Array) -> Array:
        if tuple(pred.shape) != tuple(target.shape):
            raise ValueError(
                f"MSELoss needs pred and target of the same shape, got {tuple(pred.shape)} and "
                f"{tuple(target.shape)}"
            )
        if self.reduction == "mean" and pred.size == 0:
            raise ValueError("MSELoss(reduction='mean') of an empty batch is undefined")
        xp = array_module(pred)
        diff = pred - target
        total = (diff * diff).sum()
        loss = total / pred.size if self.reduction == "mean" else total
        self._saved = {"diff": diff, "dtype": pred.dtype, "count": pred.size}
        return xp.asarray(loss)

    def backward(self, grad_scale: float = 1.0) -> Array:
        saved = self._take_saved()
        factor = 2.0 * grad_scale / (saved["count"] if self.reduction == "mean" else 1)
        return (saved["diff"] * factor).astype(saved["dtype"], copy=False)


class CrossEntropyLoss(Loss):
    """Softmax cross entropy of logits ``(..., C)`` against integer class targets ``(...)``.

    Uses log-sum-exp with the row maximum subtracted, and computes in at least
    float32 (float16 logits are upcast; the gradient comes back in their dtype).
    """

    def forward(self, pred: Array, target: Array) -> Array:
        if pred.ndim < 1 or tuple(pred.shape[:-1]) != tuple(target.shape):
            raise ValueError(
                f"CrossEntropyLoss expects logits (..., C) and targets (...), got {tuple(pred.shape)} and "
                f"{tuple(target.shape)}"
            )
        if np.dtype(target.dtype).kind not in "iu":
            raise ValueError(
                f"CrossEntropyLoss targets must be integer class ids, got {np.dtype(target.dtype)}"
            )
        num_classes = int(pred.shape[-1])
        t = target.reshape(-1)
        if t.size == 0:
            raise ValueError("CrossEntropyLoss of an empty batch is undefined")
        if int(t.min()) < 0 or int(t.max()) >= num_classes:
            raise ValueError(
                f"CrossEntropyLoss targets must lie in [0, {num_classes}), got range [{int(t.min())}, {int(t.max())}]"
            )
        xp = array_module(pred)
        compute = np.promote_types(np.dtype(pred.dtype), np.float32)
        x = pred.reshape(-1, num_classes).astype(compute, copy=False)
        rows = xp.arange(t.size)
        shifted = x - x.max(axis=1, keepdims=True)
        exp = xp.exp(shifted)
        sums = exp.sum(axis=1, keepdims=True)
        losses = xp.log(sums[:, 0]) - shifted[rows, t]
        total = losses.sum()
        loss = total / t.size if self.reduction == "mean" else total
        self._saved = {"probs": exp / sums, "t": t, "rows": rows, "shape": pred.shape, "dtype": pred.dtype}
        return xp.asarray(loss)

    def backward(self, grad_scale: float = 1.0) -> Array:
        saved = self._take_saved()
        grad = saved["probs"]
        grad[saved["rows"], saved["t"]] -= 1.0
        count = saved["t"].size
        grad *= grad_scale / count if self.reduction == "mean" else grad_scale
        return grad.reshape(saved["shape"]).astype(saved["dtype"], copy=False)
