"""The argument checks every op makes before any communication: ``ValueError`` names the mistake."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from paramplane.node.arrays import dtype_name, is_cupy, is_device
from paramplane.node.spec import check_reduce_op


def check_array(x: Any, what: str = "x", *, writable: bool = True) -> None:
    """ValueError for anything the plane cannot move in place."""
    if not (isinstance(x, np.ndarray) or is_device(x)):
        raise ValueError(f"{what} must be a numpy or cupy array, got {type(x).__name__}")
    dtype_name(x.dtype)
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{what} is not C-contiguous: pass np.ascontiguousarray({what}), or tensor.contiguous() for a torch "
            "tensor (collectives work in place)"
        )
    # cupy arrays are always writable and their flags have no `writeable`.
    if writable and isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{what} is read-only: collectives write their result into it; pass a writable copy")


def check_reduce(op: str, x: Any) -> None:
    check_reduce_op(op, np.dtype(x.dtype))


def check_out(out: Any, shape: tuple[int, ...], x: Any) -> None:
    """``out`` (None: the op allocates) must be an array like ``x`` of ``shape``."""
    if out is None:
        return
    check_array(out, "out")
    if tuple(out.shape) != shape or out.dtype != x.dtype or is_cupy(out) != is_cupy(x):
        raise ValueError(
            f"out must be a {type(x).__name__} of shape {shape} and dtype {x.dtype}, got "
            f"{type(out).__name__} {tuple(out.shape)} {out.dtype}"
        )


def is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_cupy(x)


def check_chunks(chunks: Sequence[Any], size: int) -> None:
    """A scatter source's chunks: ``size`` arrays of one shape and dtype."""
    if len(chunks) != size:
        raise ValueError(
            f"scatter on the source rank needs a sequence of {size} arrays (one per rank), got {len(chunks)}"
        )
    for i, c in enumerate(chunks):
        check_array(c, f"chunks[{i}]", writable=False)
        if c.shape != chunks[0].shape or c.dtype != chunks[0].dtype:
            raise ValueError(
                f"chunks[{i}] has shape {c.shape} and dtype {c.dtype}; chunks[0] has "
                f"{chunks[0].shape} and {chunks[0].dtype}: every chunk must match"
            )
