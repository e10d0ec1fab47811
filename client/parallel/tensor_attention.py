"""``TensorParallelAttention``: ``pp.nn.MultiHeadAttention`` with its heads split over a tensor-parallel group.

Each rank holds the q, k and v rows of its ``num_heads / tp`` heads (column parallel) and the matching columns
of the output projection (row parallel, ``RowParallelLinear``). Forward: local projections, attention on the
local heads, the output projection's all-reduce; backward: the output projection is local, and the three
input gradients are summed locally and all-reduced once (Megatron's fused QKV: one all-reduce forward and one
backward). The layer draws the dense ``MultiHeadAttention``'s seeded initialisation and keeps its slice, so it
equals the dense layer; each parameter's ``shard`` makes checkpoints hold the dense layer::

    attn = pp.TensorParallelAttention(D, H, mesh.group("tp"), rng=7)   # heads of pp.nn.MultiHeadAttention(D, H, rng=7)
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from paramplane.group import ProcessGroup
from paramplane.nn.attention import MultiHeadAttention, attend, attend_backward
from paramplane.nn.layers import Linear, RngLike
from paramplane.nn.module import Array, Module, Parameter
from paramplane.parallel.tensor import RowParallelLinear, TensorShard, _seed
from paramplane.parallel.tensor_comm import reduce_sum

__all__ = ["TensorParallelAttention"]


def _rows(full: Linear, lo: int, k: int, group: ProcessGroup, xp: ModuleType) -> Linear:
    """A Linear holding rows ``[lo, lo + k)`` of ``full`` (shards of the dense layer for checkpoints)."""
    part = Linear(full.in_features, k, full.bias is not None, dtype=full.weight.dtype, rng=0, xp=xp)
    part.weight = Parameter(full.weight.data[lo : lo + k].copy())
    part.weight.shard = TensorShard(tuple(full.weight.shape), 0, group)
    if full.bias is not None:
        part.bias = Parameter(full.bias.data[lo : lo + k].copy())
        part.bias.shard = TensorShard(tuple(full.bias.shape), 0, group)
    return part


class TensorParallelAttention(Module):
    """Causal (by default) self-attention over ``(B, S, embed_dim)`` with ``num_heads / tp`` heads per rank."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        group: ProcessGroup,
        bias: bool = True,
        causal: bool = True,
        *,
        dtype: Any = np.float32,
        rng: RngLike = None,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        if not isinstance(group, ProcessGroup):
            raise ValueError(f"TensorParallelAttention needs a ProcessGroup, got {type(group).__name__}")
        if isinstance(num_heads, int) and num_heads > 0 and num_heads % group.size:
            raise ValueError(
                f"num_heads={num_heads} does not split over the {group.size} ranks of tensor-parallel group "
                f"'{group.name}': the head count must be divisible by the tensor-parallel size"
            )
        full = MultiHeadAttention(
            embed_dim, num_heads, bias, causal, dtype=dtype, rng=_seed(rng, group), xp=xp
        )
        self.group = group
        self.embed_dim, self.num_heads, self.causal = embed_dim, num_heads, causal
        self.local_heads = num_heads // group.size
        k = embed_dim // group.size
        lo = group.rank * k
        self.q, self.k, self.v = (_rows(getattr(full, n), lo, k, group, xp) for n in ("q", "k", "v"))
        self.o = RowParallelLinear(embed_dim, embed_dim, group, bias, dtype=dtype, rng=0, xp=xp)
        self.o.load_full_weight(full.o.weight.data, full.o.bias.data if full.o.bias is not None else None)

    def forward(self, x: Array) -> Array:
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"attention expects input (batch, seq, {self.embed_dim}), got {tuple(x.shape)}")
        out, saved = attend(self.q(x), self.k(x), self.v(x), self.local_heads, self.causal)
        self._save(attn=saved)
        return self.o(out)

    def backward(self, grad_out: Array) -> Array:
        saved = self._take_saved()["attn"]
        gq, gk, gv = attend_backward(self.o.backward(grad_out), saved)
        return reduce_sum(self.q.backward(gq) + self.k.backward(gk) + self.v.backward(gv), self.group)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, tp={self.group.size}, causal={self.causal}"
