"""Optimizers over paramplane.nn parameters, with torch.optim's update rules."""

from __future__ import annotations

from paramplane.optim.adamw import AdamW
from paramplane.optim.optimizer import Optimizer, StepHook
from paramplane.optim.sgd import SGD

__all__ = ["SGD", "AdamW", "Optimizer", "StepHook"]
