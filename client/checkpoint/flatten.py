"""State trees <-> named arrays: what a ``state`` mapping holds, flattened to ``top/key`` leaves.

What ``state`` may hold: objects with ``sharded_state_dict()`` / ``load_sharded_state_dict()``
(``pp.FSDP``, ``pp.optim`` optimizers), objects with ``state_dict()`` / ``load_state_dict()``
(modules, ``pp.DDP``: replicated), and plain values (numbers, strings, lists, dicts, numpy arrays).
Numpy scalars (``np.float64(0.1)``) are plain values; any other ``__dlpack__`` tensor (torch, JAX) is seen
as a zero-copy view, so that loading fills the caller's tensor in place. Arrays whose flat view is a copy
(non-contiguous) are filled through a buffer copied back.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from paramplane.checkpoint.files import CheckpointError
from paramplane.node.arrays import array_module, from_foreign, is_device
from paramplane.parallel.sharding import ShardedArray

Fill = Callable[[str, dict[str, Any], ShardedArray], None]


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _leaf(value: Any) -> Any:
    """numpy, cupy and ShardedArray leaves as they are; a numpy scalar (``np.float64(0.1)``) as the plain
    Python value it holds (it cannot be loaded in place); any other ``__dlpack__`` tensor (torch, JAX) as a
    zero-copy numpy or cupy view, so that loading fills the caller's tensor in place."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, ShardedArray)) or is_device(value) or not hasattr(value, "__dlpack__"):
        return value
    if getattr(value, "requires_grad", False):  # a parameter: loaded in place like torch's load_state_dict
        value = value.detach()
    return from_foreign(value)[0]


def _is_torch_optimizer(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.optim.Optimizer)


def _entries(state: Mapping[str, Any]) -> dict[str, Any]:
    """Every leaf of ``state`` under ``top/key``: ShardedArray, whole array, or plain value."""
    out: dict[str, Any] = {}
    for top, obj in state.items():
        if "/" in top:
            raise ValueError(f"checkpoint keys may not contain '/': {top!r}")
        if _is_torch_optimizer(obj):
            raise CheckpointError(
                f"{top!r} is a torch.optim optimizer, whose state_dict() is keyed by position: pass the "
                "wrapper's optim_state(opt) (pp.DDP, pp.FSDP, pp.Pipeline; pp.tp_optim_state(model, opt) for a "
                "module), which keys it by parameter name"
            )
        if hasattr(obj, "sharded_state_dict") and hasattr(obj, "load_sharded_state_dict"):
            leaves = obj.sharded_state_dict()
        elif (
            hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict") and not hasattr(obj, "__dlpack__")
        ):
            leaves = obj.state_dict()
        else:
            out[top] = _leaf(obj)
            continue
        for key, value in leaves.items():
            out[f"{top}/{key}"] = _leaf(value)
    return out


def _as_sharded(value: Any) -> ShardedArray:
    """A whole array seen as the one piece that covers it."""
    if isinstance(value, ShardedArray):
        return value
    return _whole(value, value.reshape(-1))


def _flat_view(value: Any) -> Any | None:
    """The flat (1-D) view of an array leaf that writes through to it, or None when flattening it copies
    (a non-contiguous array: a transpose, a strided slice)."""
    if isinstance(value, ShardedArray):
        return value.local
    flags = getattr(value, "flags", None)
    return value.reshape(-1) if getattr(flags, "c_contiguous", False) else None


def _fill_leaf(fill: Fill, key: str, entry: dict[str, Any], target: Any) -> None:
    """``fill`` an array leaf in place: straight into its flat view, or through a buffer copied back."""
    if isinstance(target, ShardedArray):
        fill(key, entry, target)
        return
    flat = _flat_view(target)
    if flat is not None:
        fill(key, entry, _whole(target, flat))
        return
    buf = array_module(target).empty(int(target.size), target.dtype)
    fill(key, entry, _whole(target, buf))
    target[...] = buf.reshape(target.shape)


def _whole(target: Any, flat: Any) -> ShardedArray:
    return ShardedArray(tuple(int(d) for d in target.shape), 0, flat)


def _plain(key: str, value: Any) -> Any:
    """A deep copy of the plain value ``value`` through JSON (what the manifest will hold); CheckpointError
    (a ValueError) naming ``key`` when JSON cannot hold it."""

    def scalar(obj: Any) -> Any:
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")

    try:
        return json.loads(json.dumps(value, default=scalar))
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"plain value {key!r} cannot be saved ({exc}): plain values must be JSON "
            "(numbers, strings, None, lists and dicts of them)"
        ) from None


def _buffer_keys(state: Mapping[str, Any]) -> set[str]:
    """The keys of module buffers in ``state`` (``top/name``; through wrappers' ``module``): a DDP replica's
    buffers (BatchNorm statistics) move with its own batches and are re-broadcast from group rank 0 at the
    next training forward, so they may differ between ranks; the lowest rank's copy is saved, as torch's."""
    out: set[str] = set()
    for top, obj in state.items():
        module = obj
        while module is not None and not hasattr(module, "named_buffers"):
            module = getattr(module, "module", None)
        if module is not None:
            try:
                out.update(f"{top}/{name}" for name, _ in module.named_buffers())
            except Exception:  # not a module after all: no buffers to allow for
                pass
    return out


def _piece_name(key: str, piece: ShardedArray, entry: Any) -> str:
    return f"{key}[{piece.start}:{piece.stop}]" if isinstance(entry, ShardedArray) else key
