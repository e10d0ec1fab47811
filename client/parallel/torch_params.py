"""torch modules under ``pp.DDP``: each parameter seen as a paramplane ``Parameter`` through DLPack views.

The views are zero-copy numpy arrays over the torch tensors (CPU), so DDP's broadcasts write into the
module's parameters and its reduced gradients land in ``p.grad`` in place. A gradient hook is torch's
``register_post_accumulate_grad_hook``: it fires once ``p.grad`` holds this backward's gradient.
torch is imported only when a torch module is wrapped.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from paramplane.node.arrays import DTYPES


def is_torch_module(module: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(module, torch.nn.Module)


def _view(tensor: Any, what: str) -> np.ndarray:
    if tensor.device.type != "cpu":
        raise ValueError(f"DDP over a torch module needs CPU tensors; {what} is on {tensor.device}")
    try:
        view = np.from_dlpack(tensor.detach())
    except (BufferError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{what} ({tensor.dtype}) cannot be seen by numpy through DLPack: {exc}") from None
    if view.dtype not in DTYPES.values():
        raise ValueError(
            f"{what} is {tensor.dtype}, which the plane does not move; use one of {', '.join(DTYPES)}"
        )
    return view


class TorchParam:
    """One torch parameter with the interface DDP's buckets use (``data``, ``grad``, grad hooks)."""

    def __init__(self, name: str, tensor: Any) -> None:
        self.name = name
        self.tensor = tensor
        self.data = _view(tensor, f"parameter {name!r}")
        self.requires_grad = bool(tensor.requires_grad)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.data.dtype

    @property
    def size(self) -> int:
        return int(self.data.size)

    @property
    def grad(self) -> np.ndarray | None:
        g = self.tensor.grad
        return None if g is None else np.from_dlpack(g)

    @grad.setter
    def grad(self, value: np.ndarray | None) -> None:
        import torch

        self.tensor.grad = None if value is None else torch.from_numpy(np.ascontiguousarray(value))

    def register_grad_hook(self, fn: Callable[[TorchParam], None]) -> Any:
        return self.tensor.register_post_accumulate_grad_hook(lambda _t: fn(self))


def torch_params(module: Any) -> list[TorchParam]:
    return [TorchParam(name, p) for name, p in module.named_parameters()]


def torch_buffers(module: Any) -> list[tuple[str, np.ndarray]]:
    return [(name, _view(b, f"buffer {name!r}")) for name, b in module.named_buffers()]
