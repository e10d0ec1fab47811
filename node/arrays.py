"""numpy / cupy dispatch and the dtypes the plane moves.

One code path serves both array libraries: ``array_module(x)`` answers the
module that owns ``x``; cupy is imported lazily and is optional.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

import numpy as np

_PLAIN: dict[str, np.dtype[Any]] = {
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}
_WIRE_NAMES = ("float16", "bfloat16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool")


@functools.cache
def _bfloat16() -> np.dtype[Any]:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _is_bfloat16(dt: np.dtype[Any]) -> bool:
    # No array can have ml_dtypes' bfloat16 before ml_dtypes was imported: then nothing needs importing.
    return dt.kind == "V" and "ml_dtypes" in sys.modules and dt == _bfloat16()


class _Dtypes(Mapping[str, "np.dtype[Any]"]):
    """Wire name -> dtype. bfloat16 comes from ml_dtypes on the host, imported on its first use (2 MB of RSS
    that a rank which never moves bfloat16 does not hold)."""

    def __getitem__(self, name: str) -> np.dtype[Any]:
        return _bfloat16() if name == "bfloat16" else _PLAIN[name]

    def __contains__(self, name: object) -> bool:
        return name in _WIRE_NAMES

    def __iter__(self) -> Iterator[str]:
        return iter(_WIRE_NAMES)

    def __len__(self) -> int:
        return len(_WIRE_NAMES)


# Wire names of the dtypes the plane moves.
DTYPES: Mapping[str, np.dtype[Any]] = _Dtypes()


@functools.cache
def cupy_module() -> ModuleType | None:
    """The cupy module, or None where it is not installed or finds no device."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:
        return None


# Other device array libraries by the module prefix of their array type (tests register a recording
# stand-in for cupy here, so device/host data movement is checked on machines without a GPU).
_DEVICE_MODULES: dict[str, ModuleType] = {}


def register_device_module(type_module_prefix: str, module: ModuleType) -> None:
    """Treat arrays whose type lives in a module starting with ``type_module_prefix`` as device arrays of
    ``module`` (which offers numpy's API plus ``asarray`` to the device and ``x.get()`` back)."""
    _DEVICE_MODULES[type_module_prefix] = module


def is_cupy(x: Any) -> bool:
    """True when ``x`` is a cupy array (without importing cupy when it was never imported)."""
    return type(x).__module__.startswith("cupy")


def _registered(x: Any) -> ModuleType | None:
    if _DEVICE_MODULES:
        name = type(x).__module__
        for prefix, module in _DEVICE_MODULES.items():
            if name.startswith(prefix):
                return module
    return None


def is_device(x: Any) -> bool:
    """True for device arrays: cupy's, or a registered device module's."""
    return is_cupy(x) or _registered(x) is not None


def array_module(x: Any) -> ModuleType:
    """numpy, cupy or a registered device module, whichever owns ``x``."""
    if is_cupy(x):
        import cupy

        return cupy
    return _registered(x) or np


_NAMES = {dt: name for name, dt in _PLAIN.items()}


def is_floating(dtype: Any) -> bool:
    """numpy/cupy floating dtypes and ml_dtypes' bfloat16 (whose numpy kind is ``"V"``, not ``"f"``)."""
    dt = np.dtype(dtype)
    return dt.kind == "f" or _is_bfloat16(dt)


def is_moved(dtype: Any) -> bool:
    """Whether the plane moves ``dtype`` (it has a wire name in ``DTYPES``)."""
    dt = np.dtype(dtype)
    return dt in _NAMES or _is_bfloat16(dt)


def dtype_name(dtype: Any) -> str:
    """The wire name of ``dtype``; ValueError for one the plane does not move."""
    dt = np.dtype(dtype)
    name = _NAMES.get(dt)
    if name is None:
        if _is_bfloat16(dt):
            return "bfloat16"
        raise ValueError(f"dtype {dt} is not supported; use one of {', '.join(DTYPES)}")
    return name


def to_host(x: Any) -> np.ndarray[Any, Any]:
    """A numpy copy (device array) or the array itself (numpy)."""
    return x.get() if is_device(x) else np.asarray(x)


def to_pinned(x: Any, out: np.ndarray[Any, Any] | None = None) -> np.ndarray[Any, Any]:
    """A host copy of the device array ``x`` in page-locked memory for cupy (fast, asynchronous-capable
    transfers), written into ``out`` when it is a host array of the same shape and dtype."""
    if out is None or out.shape != x.shape or out.dtype != x.dtype:
        if is_cupy(x):
            import cupyx

            out = cupyx.empty_pinned(x.shape, x.dtype)
        else:
            out = np.empty(x.shape, x.dtype)
    x.get(out=out)
    return out


def device_of(x: Any) -> Any:
    """A context manager that makes ``x``'s GPU current (cupy), or does nothing (host arrays, whose numpy
    ``device`` is the string "cpu")."""
    device = getattr(x, "device", None)
    return device if hasattr(device, "__enter__") else contextlib.nullcontext()


def on_module(xp: ModuleType, x: Any) -> Any:
    """``x`` as an array of ``xp`` (numpy or cupy), copying across host and device as needed."""
    return to_host(x) if xp is np else xp.asarray(x)


def from_foreign(x: Any) -> tuple[Any, Any]:
    """``(array, wrap)``: numpy and cupy arrays as they are; any other ``__dlpack__`` object (a torch or JAX
    tensor) as a zero-copy numpy view (CPU) or cupy view (CUDA), so an in-place op changes the caller's
    tensor. ``wrap(result)`` turns a new result array back into the caller's library when it has a
    ``from_dlpack`` (torch does), else returns it as is."""
    if isinstance(x, np.ndarray) or is_cupy(x) or not hasattr(x, "__dlpack__"):
        return x, _same
    device_type = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else 1
    if getattr(x, "requires_grad", False):
        raise ValueError(
            "the tensor requires grad: an in-place collective would change it behind autograd's back; pass "
            "tensor.detach() (same storage), e.g. under torch.no_grad()"
        )
    if device_type == 1 and type(x).__module__.startswith("torch"):
        return torch_cpu_view(x), to_torch
    if device_type == 1:  # kDLCPU
        view = np.from_dlpack(x)
    else:
        import cupy

        view = cupy.from_dlpack(x)
    library = sys.modules.get(type(x).__module__.split(".")[0])
    convert = getattr(library, "from_dlpack", None)
    return view, (convert if callable(convert) else _same)


def _same(x: Any) -> Any:
    return x


def torch_cpu_view(tensor: Any) -> np.ndarray[Any, Any]:
    """A zero-copy numpy view of a CPU torch tensor: detached (for callers that own the tensor's state, such as
    DDP over a module and checkpoints; the same storage), bfloat16 through an int16 view (numpy takes no
    bfloat16 over DLPack)."""
    tensor = tensor.detach()
    if str(tensor.dtype) == "torch.bfloat16":
        import torch

        return tensor.view(torch.int16).numpy().view(DTYPES["bfloat16"])
    return tensor.numpy()  # the same storage as np.from_dlpack(tensor), in half its time


def to_torch(array: np.ndarray[Any, Any]) -> Any:
    """A zero-copy torch tensor over a numpy array (bfloat16 included)."""
    import torch

    if _is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
