"""Tensor parallel's communication, as Megatron's conjugate mappings (``tensor_parallel/mappings.py``).

Each forward collective has its conjugate in backward: a copy to the group (identity forward)
all-reduces gradients; a reduction from the group (all-reduce forward) passes gradients
through; a gather along the last axis splits gradients; a split gathers them.
"""

from __future__ import annotations

from paramplane.group import ProcessGroup
from paramplane.nn.module import Array
from paramplane.node.arrays import array_module


def split_last(x: Array, group: ProcessGroup) -> Array:
    """This rank's equal slice of ``x`` along its last axis."""
    size = x.shape[-1]
    if size % group.size:
        raise ValueError(
            f"last axis of size {size} does not split evenly over {group.size} tensor-parallel ranks"
        )
    k = size // group.size
    return array_module(x).ascontiguousarray(x[..., group.rank * k : (group.rank + 1) * k])


def gather_last(x: Array, group: ProcessGroup) -> Array:
    """Every rank's ``x`` concatenated along the last axis, in group order."""
    xp = array_module(x)
    front = xp.ascontiguousarray(xp.moveaxis(x, -1, 0))
    gathered = group.all_gather(front)
    return xp.ascontiguousarray(xp.moveaxis(gathered, 0, -1))


def reduce_sum(x: Array, group: ProcessGroup) -> Array:
    """The sum of ``x`` (a fresh array the caller owns) over the group, in place."""
    return group.all_reduce(array_module(x).ascontiguousarray(x), "sum")
