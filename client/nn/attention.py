"""Multi-head self-attention with explicit backward (numpy and cupy), the dense reference for
``pp.TensorParallelAttention``.

``attend`` / ``attend_backward`` are the core on projected q, k, v of shape ``(B, S, H * head_dim)``: scaled
dot products per head, an optional causal mask, softmax, the weighted sum of values. The module adds the q, k,
v and output projections (``Linear`` layers drawn from one generator in that order).
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np

from paramplane.nn.layers import Linear, RngLike, make_rng
from paramplane.nn.module import Array, Module
from paramplane.node.arrays import array_module

__all__ = ["MultiHeadAttention", "attend", "attend_backward"]


def _heads(t: Array, heads: int) -> Array:
    b, s, f = t.shape
    return t.reshape(b, s, heads, f // heads).transpose(0, 2, 1, 3)


def _merge(t: Array) -> Array:
    b, h, s, d = t.shape
    return array_module(t).ascontiguousarray(t.transpose(0, 2, 1, 3)).reshape(b, s, h * d)


def attend(q: Array, k: Array, v: Array, heads: int, causal: bool) -> tuple[Array, dict[str, Any]]:
    """The attention output ``(B, S, H * head_dim)`` and what ``attend_backward`` needs."""
    xp = array_module(q)
    qh, kh, vh = _heads(q, heads), _heads(k, heads), _heads(v, heads)
    scale = 1.0 / math.sqrt(qh.shape[-1])
    scores = (qh @ kh.transpose(0, 1, 3, 2)) * scale
    if causal:
        s = scores.shape[-1]
        scores = xp.where(xp.tril(xp.ones((s, s), bool)), scores, -xp.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = xp.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return _merge(p @ vh), {"p": p, "qh": qh, "kh": kh, "vh": vh, "scale": scale, "heads": heads}


def attend_backward(grad: Array, saved: dict[str, Any]) -> tuple[Array, Array, Array]:
    """Gradients of q, k and v from the gradient of ``attend``'s output."""
    p, qh, kh, vh = saved["p"], saved["qh"], saved["kh"], saved["vh"]
    g = _heads(grad, saved["heads"])
    gv = p.transpose(0, 1, 3, 2) @ g
    gp = g @ vh.transpose(0, 1, 3, 2)
    gs = p * (gp - (gp * p).sum(axis=-1, keepdims=True)) * saved["scale"]
    return _merge(gs @ kh), _merge(gs.transpose(0, 1, 3, 2) @ qh), _merge(gv)


class MultiHeadAttention(Module):
    """Self-attention over ``x`` of shape ``(B, S, embed_dim)`` with ``num_heads`` heads (causal by default)."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        bias: bool = True,
        causal: bool = True,
        *,
        dtype: Any = np.float32,
        rng: RngLike = None,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive integer, got {num_heads!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
        gen = make_rng(rng)
        self.embed_dim, self.num_heads, self.causal = embed_dim, num_heads, causal
        self.q, self.k, self.v, self.o = (
            Linear(embed_dim, embed_dim, bias, dtype=dtype, rng=gen, xp=xp) for _ in range(4)
        )

    def forward(self, x: Array) -> Array:
        if x.ndim != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"attention expects input (batch, seq, {self.embed_dim}), got {tuple(x.shape)}")
        out, saved = attend(self.q(x), self.k(x), self.v(x), self.num_heads, self.causal)
        self._save(attn=saved)
        return self.o(out)

    def backward(self, grad_out: Array) -> Array:
        saved = self._take_saved()["attn"]
        gq, gk, gv = attend_backward(self.o.backward(grad_out), saved)
        return self.q.backward(gq) + self.k.backward(gk) + self.v.backward(gv)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, causal={self.causal}"
