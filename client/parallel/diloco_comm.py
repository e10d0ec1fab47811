"""How DiLoCo averages an outer gradient over the replicas, at the wire dtype it was asked for.

``start_mean(group, flat, wire)`` starts the collectives asynchronously and returns a function that waits
for them and gives the replicas' mean of ``flat`` (same dtype and shape). Bytes one replica hands to the
group for ``n`` elements of a float32 outer gradient:

- ``None``: ``all_reduce(op="mean")`` of ``flat`` itself: ``4n`` (``8n`` for float64).
- ``"bfloat16"`` / ``"float16"``: ``flat`` cast to that dtype, ``all_reduce(op="mean")``, cast back: ``2n``.
  (The mean is accumulated in the wire dtype, like torch's ``bf16_compress_hook``.)
- ``"int8"``: blocks of ``INT8_BLOCK`` elements, each quantised symmetrically (``q = rint(x / s)``, ``s =
  max|x| / 127``, ``|q| <= 127``); int8 values cannot be summed on the wire, so every replica
  ``all_gather``s the int8 payload and the float32 scales (``n + 4 * ceil(n / 256)`` bytes, about
  ``1.016n``) and dequantises and averages every replica's contribution locally. Each contribution is off by
  at most ``s / 2`` per element (half a step of its block), so the mean is off by at most the mean of those.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.node.arrays import DTYPES, array_module

WIRE_DTYPES = (None, "bfloat16", "float16", "int8")
INT8_BLOCK = 256

Array = Any


def quantize_int8(flat: Array, block: int = INT8_BLOCK) -> tuple[Array, Array]:
    """``(q, scales)``: ``flat`` (1-D float) as int8 values, zero-padded to whole blocks, and one float32
    scale per block (``dequantize_int8(q, scales)[:n]`` approximates ``flat``)."""
    xp = array_module(flat)
    n = int(flat.size)
    blocks = max(1, math.ceil(n / block))
    padded = xp.zeros(blocks * block, dtype=np.float32)
    padded[:n] = flat
    rows = padded.reshape(blocks, block)
    scales = (xp.abs(rows).max(axis=1) / 127.0).astype(np.float32)
    safe = xp.where(scales > 0, scales, np.float32(1.0))
    q = xp.clip(xp.rint(rows / safe[:, None]), -127, 127).astype(np.int8)
    return q.reshape(-1), scales


def dequantize_int8(q: Array, scales: Array, block: int = INT8_BLOCK) -> Array:
    """The float32 values ``q`` (int8, whole blocks) and ``scales`` stand for (1-D, padding included)."""
    return (q.reshape(-1, block).astype(np.float32) * scales[:, None]).reshape(-1)


def start_mean(group: ProcessGroup, flat: Array, wire: str | None) -> Callable[[], Array]:
    """Start averaging ``flat`` over ``group`` (see the module docstring); the returned function waits and
    returns the mean. ``flat`` is not modified for a wire dtype (it is, in place, without one)."""
    if wire is None:
        work = group.all_reduce(flat, op="mean", async_op=True)

        def done_plain() -> Array:
            work.wait()
            return flat

        return done_plain
    if wire in ("bfloat16", "float16"):
        cast = flat.astype(DTYPES[wire])
        work = group.all_reduce(cast, op="mean", async_op=True)

        def done_cast() -> Array:
            work.wait()
            return cast.astype(flat.dtype)

        return done_cast
    if wire != "int8":
        raise ValueError(f"outer_dtype must be one of {WIRE_DTYPES}, got {wire!r}")
    q, scales = quantize_int8(flat)
    q_work = group.all_gather(q, async_op=True)
    s_work = group.all_gather(scales, async_op=True)

    def done_int8() -> Array:
        all_q, all_s = q_work.wait(), s_work.wait()
        n, r = int(flat.size), group.size
        total = dequantize_int8(all_q, all_s).reshape(r, -1)[:, :n].astype(flat.dtype)
        return total.sum(axis=0) / r

    return done_int8
