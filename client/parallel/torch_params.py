"""torch modules under ``pp.DDP`` and ``pp.FSDP``: each parameter seen as a paramplane ``Parameter`` through
DLPack views (``TorchFlatParam``: FSDP re-points the tensor at pieces of its flat buffers).

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

from paramplane.node.arrays import DTYPES, to_torch, torch_cpu_view

__all__ = [
    "TorchFlatParam",
    "TorchParam",
    "is_torch_module",
    "queue_backward_callback",
    "to_numpy",
    "to_torch",
    "torch_buffers",
    "torch_params",
]


def is_torch_module(module: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(module, torch.nn.Module)


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn()`` when the backward that is running now ends (call it from inside an autograd hook).

    What torch's DDP reducer and FSDP2 do to make gradients final when ``loss.backward()`` returns: the
    engine runs queued callbacks after the last node of the graph task, before ``backward()`` returns.
    """
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def to_numpy(tensor: Any, what: str) -> np.ndarray:
    """A zero-copy numpy view of a CPU torch tensor (bfloat16 through an int16 view, as ml_dtypes')."""
    if tensor.device.type != "cpu":
        raise ValueError(f"paramplane over a torch module needs CPU tensors; {what} is on {tensor.device}")
    try:
        view = torch_cpu_view(tensor)
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
        self.data = to_numpy(tensor, f"parameter {name!r}")
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
        return None if g is None else to_numpy(g, f"the gradient of {self.name!r}")

    @grad.setter
    def grad(self, value: np.ndarray | None) -> None:
        self.tensor.grad = None if value is None else to_torch(np.ascontiguousarray(value))

    def register_grad_hook(self, fn: Callable[[TorchParam], None]) -> Any:
        return self.tensor.register_post_accumulate_grad_hook(lambda _t: fn(self))

    def register_grad_pre_hook(self, fn: Callable[[TorchParam], None]) -> Any:
        """``fn(param)`` when a backward has computed a gradient for it, before torch adds it to ``grad``."""

        def hook(grad: Any) -> None:
            fn(self)

        return self.tensor.register_hook(hook)


class TorchFlatParam(TorchParam):
    """A torch parameter whose values FSDP re-points: assigning ``data`` swaps the tensor's data.

    A writable array becomes the tensor's data zero-copy (a view into the unit's gathered flat buffer);
    a read-only one is FSDP's sharded placeholder and becomes a zero-stride tensor of the same shape,
    as torch's FSDP frees a parameter's storage while keeping its metadata. Autograd keeps the tensor
    object, so a backward after re-gathering sees the gathered values again.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value
        if value.flags.writeable:
            self.tensor.data = to_torch(value)
        else:
            self.tensor.data = to_torch(np.zeros((), value.dtype)).expand(value.shape)


def torch_params(module: Any) -> list[TorchParam]:
    return [TorchParam(name, p) for name, p in module.named_parameters()]


def torch_buffers(module: Any) -> list[tuple[str, np.ndarray]]:
    return [(name, to_numpy(b, f"buffer {name!r}")) for name, b in module.named_buffers()]
