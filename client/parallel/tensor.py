"""Tensor parallelism: Megatron's column- and row-parallel linear layers with exact explicit backward.

``ColumnParallelLinear`` splits the output features: each rank holds ``out_f / tp`` rows of the
weight; its forward is local (the input is replicated) and its backward all-reduces the input
gradient. ``RowParallelLinear`` splits the input features: each rank holds ``in_f / tp`` columns;
its forward all-reduces the partial products and adds the (replicated) bias once, and its
backward is local. A column layer followed by a row layer (``input_is_parallel=True``) needs one
all-reduce forward and one backward. Both layers draw the full ``pp.nn.Linear``'s seeded
initialisation and keep their slice, so a TP model equals the dense one::

    col = pp.ColumnParallelLinear(D, H, mesh.group("tp"), rng=5)   # the rows of pp.nn.Linear(D, H, rng=5)
    row = pp.RowParallelLinear(H, D, mesh.group("tp"), rng=6)      # the columns of pp.nn.Linear(H, D, rng=6)

Without ``rng`` group rank 0 draws a seed and every rank uses it (a collective: every rank of the group
builds its layers in the same order), so the shards still come from one dense layer and the replicated
bias is the same everywhere. Checkpoints (``pp.checkpoint``) hold the dense layer: each parameter's
``shard`` (a ``TensorShard``) gives the piece of the dense array a rank writes and takes it back on load,
so a checkpoint loads on any tensor-parallel size and into the dense model.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.layers import Linear, RngLike
from paramplane.nn.module import Array, Module, Parameter
from paramplane.node.arrays import array_module
from paramplane.parallel.sharding import ShardedArray
from paramplane.parallel.tensor_comm import gather_last, reduce_sum, split_last

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorShard"]


class TensorShard:
    """A parameter (or any array shaped like it, e.g. an optimizer moment) that is this rank's equal slice of
    a dense array of ``global_shape`` along ``axis`` (0 or the last) over ``group``, as checkpoints see it.

    A slice of rows is one contiguous range of the dense array: it is described in place. A slice of the
    last axis is not: ``entry`` gathers the dense array (a collective) and group rank 0 describes it whole,
    the others an empty piece; ``load`` broadcasts it from group rank 0 and keeps this rank's slice.
    """

    def __init__(self, global_shape: tuple[int, ...], axis: int, group: ProcessGroup) -> None:
        assert axis in (0, len(global_shape) - 1), axis
        self.global_shape, self.axis, self.group = global_shape, axis, group

    def entry(self, local: Array) -> ShardedArray:
        """The piece of the dense array this rank writes (a view of ``local`` for a slice of rows)."""
        xp = array_module(local)
        if self.axis == 0:
            flat = xp.ascontiguousarray(local).reshape(-1)
            return ShardedArray(self.global_shape, self.group.rank * int(local.size), flat)
        full = gather_last(local, self.group).reshape(-1)
        return ShardedArray(self.global_shape, 0, full if self.group.rank == 0 else full[:0])

    def load(self, local: Array, entry: ShardedArray) -> None:
        """Set ``local`` from ``entry`` (what ``entry`` gave, filled by a loader)."""
        xp = array_module(local)
        if self.axis == 0:
            local[...] = xp.asarray(entry.local).reshape(local.shape)
            return
        if self.group.rank == 0:
            full = xp.ascontiguousarray(xp.asarray(entry.local).reshape(self.global_shape))
        else:
            full = xp.empty(self.global_shape, local.dtype)
        self.group.broadcast(full, 0)
        k = local.shape[-1]
        local[...] = full[..., self.group.rank * k : (self.group.rank + 1) * k]


def _seed(rng: RngLike, group: ProcessGroup) -> RngLike:
    """``rng``, or for None a seed drawn on group rank 0 and shared (every rank must slice one dense layer)."""
    if rng is not None:
        return rng
    seed = np.array([np.random.default_rng().integers(1 << 62) if group.rank == 0 else 0], np.int64)
    return int(group.broadcast(seed, 0)[0])


def _check(group: ProcessGroup, features: int, what: str) -> int:
    if not isinstance(group, ProcessGroup):
        raise ValueError(f"tensor-parallel layers need a ProcessGroup, got {type(group).__name__}")
    if features % group.size:
        raise ValueError(
            f"{what}={features} does not split evenly over the {group.size} ranks of group '{group.name}'; "
            f"use a multiple of {group.size}"
        )
    return features // group.size


def _check_dense(layer: Any, weight: Array, bias: Array | None) -> None:
    """ValueError unless ``(weight, bias)`` is the dense layer ``layer`` stands for."""
    if tuple(weight.shape) != (layer.out_features, layer.in_features):
        raise ValueError(
            f"weight must be ({layer.out_features}, {layer.in_features}), got {tuple(weight.shape)}"
        )
    if layer.bias is not None and (bias is None or tuple(bias.shape) != (layer.out_features,)):
        raise ValueError(f"bias must have shape ({layer.out_features},)")
    if layer.bias is None and bias is not None:
        raise ValueError("this layer has no bias (bias=False): pass bias=None")


class ColumnParallelLinear(Module):
    """``y = x @ W.T + b`` with W's rows (output features) split over ``group``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ProcessGroup,
        bias: bool = True,
        gather_output: bool = False,
        *,
        dtype: Any = np.float32,
        rng: RngLike = None,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        k = _check(group, out_features, "out_features")
        full = Linear(in_features, out_features, bias, dtype=dtype, rng=_seed(rng, group), xp=xp)
        self.group = group
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        lo = group.rank * k
        self.weight = Parameter(full.weight.data[lo : lo + k].copy())
        self.weight.shard = TensorShard((out_features, in_features), 0, group)
        self.bias: Parameter | None = None
        if full.bias is not None:
            self.bias = Parameter(full.bias.data[lo : lo + k].copy())
            self.bias.shard = TensorShard((out_features,), 0, group)

    def forward(self, x: Array) -> Array:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"ColumnParallelLinear expects input (..., {self.in_features}), got {tuple(x.shape)}"
            )
        self._save(x=x)
        y = x @ self.weight.data.T
        if self.bias is not None:
            y += self.bias.data
        return gather_last(y, self.group) if self.gather_output else y

    def backward(self, grad_out: Array) -> Array:
        x = self._take_saved()["x"]
        g = split_last(grad_out, self.group) if self.gather_output else grad_out
        g2 = g.reshape(-1, g.shape[-1])
        grad_in = reduce_sum(g @ self.weight.data, self.group)
        if self.bias is not None and self.bias.requires_grad:
            self.bias.accumulate_grad(g2.sum(axis=0), take=True)
        if self.weight.requires_grad:
            self.weight.accumulate_grad(g2.T @ x.reshape(-1, self.in_features), take=True)
        return grad_in

    def full_weight(self) -> tuple[Array, Array | None]:
        """The dense ``(weight, bias)`` on every rank."""
        weight = self.group.all_gather(array_module(self.weight.data).ascontiguousarray(self.weight.data))
        bias = self.group.all_gather(self.bias.data) if self.bias is not None else None
        return weight, bias

    def load_full_weight(self, weight: Array, bias: Array | None = None) -> None:
        """Set this rank's shards from the dense ``(weight, bias)``."""
        _check_dense(self, weight, bias)
        k = self.weight.shape[0]
        lo = self.group.rank * k
        self.weight.data[...] = array_module(self.weight.data).asarray(weight[lo : lo + k])
        if self.bias is not None:
            assert bias is not None  # checked above
            self.bias.data[...] = array_module(self.bias.data).asarray(bias[lo : lo + k])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self.group.size}"


class RowParallelLinear(Module):
    """``y = x @ W.T + b`` with W's columns (input features) split over ``group``; b added once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ProcessGroup,
        bias: bool = True,
        input_is_parallel: bool = True,
        *,
        dtype: Any = np.float32,
        rng: RngLike = None,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        k = _check(group, in_features, "in_features")
        full = Linear(in_features, out_features, bias, dtype=dtype, rng=_seed(rng, group), xp=xp)
        self.group = group
        self.in_features, self.out_features, self.input_is_parallel = (
            in_features,
            out_features,
            input_is_parallel,
        )
        lo = group.rank * k
        self.weight = Parameter(xp.ascontiguousarray(full.weight.data[:, lo : lo + k]))
        self.weight.shard = TensorShard((out_features, in_features), 1, group)
        self.bias: Parameter | None = Parameter(full.bias.data.copy()) if full.bias is not None else None

    def forward(self, x: Array) -> Array:
        local = self.weight.shape[1]
        if not self.input_is_parallel:
            if x.shape[-1] != self.in_features:
                raise ValueError(
                    f"RowParallelLinear expects input (..., {self.in_features}), got {tuple(x.shape)}"
                )
            x = split_last(x, self.group)
        elif x.shape[-1] != local:
            raise ValueError(
                f"RowParallelLinear with input_is_parallel expects this rank's slice (..., {local}), got {tuple(x.shape)}"
            )
        self._save(x=x)
        y = reduce_sum(x @ self.weight.data.T, self.group)
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, grad_out: Array) -> Array:
        x = self._take_saved()["x"]
        g2 = grad_out.reshape(-1, self.out_features)
        grad_in = grad_out @ self.weight.data
        if self.bias is not None and self.bias.requires_grad:
            self.bias.accumulate_grad(g2.sum(axis=0), take=True)
        if self.weight.requires_grad:
            self.weight.accumulate_grad(g2.T @ x.reshape(-1, x.shape[-1]), take=True)
        return grad_in if self.input_is_parallel else gather_last(grad_in, self.group)

    def full_weight(self) -> tuple[Array, Array | None]:
        """The dense ``(weight, bias)`` on every rank."""
        weight = gather_last(self.weight.data, self.group)
        return weight, (self.bias.data.copy() if self.bias is not None else None)

    def load_full_weight(self, weight: Array, bias: Array | None = None) -> None:
        """Set this rank's shards from the dense ``(weight, bias)``."""
        _check_dense(self, weight, bias)
        k = self.weight.shape[1]
        lo = self.group.rank * k
        self.weight.data[...] = array_module(self.weight.data).asarray(weight[:, lo : lo + k])
        if self.bias is not None:
            self.bias.data[...] = array_module(self.bias.data).asarray(bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tp={self.group.size}"
