"""Layers with explicit backward: Linear, ReLU, GELU, LayerNorm, Embedding, Dropout, Sequential.

Every layer works on numpy and cupy alike (the array module is taken from the
input) and accepts leading batch dimensions ``(N, ..., features)``. Parameter
gradients are computed, then the input gradient, and only then handed to
:meth:`Parameter.accumulate_grad` (bias before weight), so a grad hook that
frees or reshards a weight never races this layer's own backward, and hooks
fire in the reverse of ``parameters()`` order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from types import ModuleType
from typing import Any, overload

import numpy as np

from paramplane.nn.module import Array, Module, Parameter
from paramplane.node.arrays import array_module

RngLike = None | int | np.random.Generator
"""Initialisation randomness: None (fresh OS entropy), a seed, or a Generator to share a stream."""


def make_rng(rng: RngLike) -> np.random.Generator:
    """A numpy Generator from a seed, an existing Generator (returned as is) or None."""
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or (isinstance(rng, (int, np.integer)) and not isinstance(rng, bool)):
        return np.random.default_rng(rng)
    raise ValueError(f"rng must be None, an int seed or a numpy Generator, got {type(rng).__name__}")


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _host_param(values: np.ndarray[Any, Any], dtype: Any, xp: ModuleType) -> Parameter:
    """Cast host-drawn init values to ``dtype`` and move them to ``xp``."""
    return Parameter(xp.asarray(values.astype(np.dtype(dtype))))


class Linear(Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape (out, in).

    Init like torch: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)), drawn on the
    host (weight first, then bias) so a seed gives the same values everywhere.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: Any = np.float32,
        rng: RngLike = None,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        self.in_features = _positive_int("in_features", in_features)
        self.out_features = _positive_int("out_features", out_features)
        gen = make_rng(rng)
        bound = 1.0 / math.sqrt(self.in_features)
        w = gen.uniform(-bound, bound, size=(self.out_features, self.in_features))
        self.weight = _host_param(w, dtype, xp)
        self.bias: Parameter | None = None
        if bias:
            self.bias = _host_param(gen.uniform(-bound, bound, size=(self.out_features,)), dtype, xp)

    def forward(self, x: Array) -> Array:
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"Linear expects input (..., {self.in_features}), got shape {tuple(x.shape)}")
        self._save(x=x)
        y = x @ self.weight.data.T
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, grad_out: Array) -> Array:
        x = self._take_saved()["x"]
        expected = (*x.shape[:-1], self.out_features)
        if tuple(grad_out.shape) != expected:
            raise ValueError(f"Linear.backward expects grad of shape {expected}, got {tuple(grad_out.shape)}")
        g2 = grad_out.reshape(-1, self.out_features)
        grad_in = grad_out @ self.weight.data
        grad_b = g2.sum(axis=0) if self.bias is not None and self.bias.requires_grad else None
        grad_w = g2.T @ x.reshape(-1, self.in_features) if self.weight.requires_grad else None
        if self.bias is not None and grad_b is not None:
            self.bias.accumulate_grad(grad_b, take=True)
        if grad_w is not None:
            self.weight.accumulate_grad(grad_w, take=True)
        return grad_in

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


class ReLU(Module):
    """``max(x, 0)``; the gradient at 0 is 0 (as in torch)."""

    def forward(self, x: Array) -> Array:
        mask = x > 0
        self._save(mask=mask)
        return x * mask

    def backward(self, grad_out: Array) -> Array:
        return grad_out * self._take_saved()["mask"]


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


class GELU(Module):
    """GELU, tanh approximation (torch's ``GELU(approximate="tanh")``):

    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``.
    """

    def forward(self, x: Array) -> Array:
        xp = array_module(x)
        t = xp.tanh(_GELU_C * (x + _GELU_K * x * x * x))
        self._save(x=x, t=t)
        return 0.5 * x * (1.0 + t)

    def backward(self, grad_out: Array) -> Array:
        saved = self._take_saved()
        x, t = saved["x"], saved["t"]
        dinner = _GELU_C * (1.0 + 3.0 * _GELU_K * x * x)
        return grad_out * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner)


class LayerNorm(Module):
    """Normalise over the trailing ``normalized_shape`` dims (biased variance), then ``* weight + bias``."""

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        *,
        dtype: Any = np.float32,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) else normalized_shape
        self.normalized_shape = tuple(_positive_int("normalized_shape", int(d)) for d in shape)
        if not self.normalized_shape:
            raise ValueError("normalized_shape must name at least one dimension")
        if not eps > 0:
            raise ValueError(f"eps must be positive, got {eps!r}")
        self.eps = float(eps)
        self.weight: Parameter | None = None
        self.bias: Parameter | None = None
        if elementwise_affine:
            self.weight = Parameter(xp.ones(self.normalized_shape, dtype=dtype))
            self.bias = Parameter(xp.zeros(self.normalized_shape, dtype=dtype))

    def _axes(self) -> tuple[int, ...]:
        return tuple(range(-len(self.normalized_shape), 0))

    def forward(self, x: Array) -> Array:
        k = len(self.normalized_shape)
        if x.ndim < k or tuple(x.shape[-k:]) != self.normalized_shape:
            raise ValueError(
                f"LayerNorm expects input (..., {', '.join(map(str, self.normalized_shape))}), "
                f"got shape {tuple(x.shape)}"
            )
        xp = array_module(x)
        axes = self._axes()
        xc = x - x.mean(axis=axes, keepdims=True)
        rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=axes, keepdims=True) + self.eps)
        xhat = xc * rstd
        self._save(xhat=xhat, rstd=rstd)
        if self.weight is None or self.bias is None:
            return xhat
        return xhat * self.weight.data + self.bias.data

    def backward(self, grad_out: Array) -> Array:
        saved = self._take_saved()
        xhat, rstd = saved["xhat"], saved["rstd"]
        if tuple(grad_out.shape) != tuple(xhat.shape):
            raise ValueError(
                f"LayerNorm.backward expects grad of shape {tuple(xhat.shape)}, got {tuple(grad_out.shape)}"
            )
        axes = self._axes()
        lead = tuple(range(grad_out.ndim - len(self.normalized_shape)))
        dxhat = grad_out if self.weight is None else grad_out * self.weight.data
        grad_in = rstd * (
            dxhat
            - dxhat.mean(axis=axes, keepdims=True)
            - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True)
        )
        if self.weight is not None and self.bias is not None:
            grad_b = grad_out.sum(axis=lead)
            grad_w = (grad_out * xhat).sum(axis=lead)
            self.bias.accumulate_grad(grad_b, take=True)
            self.weight.accumulate_grad(grad_w, take=True)
        return grad_in

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class Embedding(Module):
    """Rows of ``weight`` (num_embeddings, embedding_dim) picked by integer indices; init N(0, 1).

    ``backward`` scatter-adds into the weight gradient (repeated indices sum) and
    returns None: integer inputs have no gradient.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        dtype: Any = np.float32,
        rng: RngLike = None,
        xp: ModuleType = np,
    ) -> None:
        super().__init__()
        self.num_embeddings = _positive_int("num_embeddings", num_embeddings)
        self.embedding_dim = _positive_int("embedding_dim", embedding_dim)
        w = make_rng(rng).standard_normal((self.num_embeddings, self.embedding_dim))
        self.weight = _host_param(w, dtype, xp)

    def forward(self, x: Array) -> Array:
        if np.dtype(x.dtype).kind not in "iu":
            raise ValueError(f"Embedding expects integer indices, got dtype {np.dtype(x.dtype)}")
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.num_embeddings):
            raise ValueError(
                f"Embedding indices must lie in [0, {self.num_embeddings}), got range "
                f"[{int(x.min())}, {int(x.max())}]"
            )
        self._save(idx=x)
        return self.weight.data[x]

    def backward(self, grad_out: Array) -> None:
        idx = self._take_saved()["idx"]
        expected = (*idx.shape, self.embedding_dim)
        if tuple(grad_out.shape) != expected:
            raise ValueError(
                f"Embedding.backward expects grad of shape {expected}, got {tuple(grad_out.shape)}"
            )
        if self.weight.requires_grad:
            xp = array_module(grad_out)
            grad_w = xp.zeros(self.weight.shape, dtype=grad_out.dtype)
            xp.add.at(grad_w, idx.reshape(-1), grad_out.reshape(-1, self.embedding_dim))
            self.weight.accumulate_grad(grad_w, take=True)
        return None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class Dropout(Module):
    """Zero each element with probability ``p`` and scale the rest by ``1/(1-p)``; identity in eval.

    Masks come from a numpy Generator seeded by ``seed`` (drawn on the host and
    moved to the input's device), so one seed gives the same sequence of masks
    on numpy and cupy.
    """

    def __init__(self, p: float = 0.5, seed: RngLike = None) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability must lie in [0, 1], got {p!r}")
        self.p = float(p)
        self._rng = make_rng(seed)

    def forward(self, x: Array) -> Array:
        if not self.training or self.p == 0.0:
            self._save(mask=None)
            return x
        keep = self._rng.random(tuple(x.shape)) >= self.p
        scale = 0.0 if self.p == 1.0 else 1.0 / (1.0 - self.p)
        mask = array_module(x).asarray((keep * scale).astype(np.dtype(x.dtype)))
        self._save(mask=mask)
        return x * mask

    def backward(self, grad_out: Array) -> Array:
        mask = self._take_saved()["mask"]
        return grad_out if mask is None else grad_out * mask

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Sequential(Module):
    """Modules applied in order; children are named ``"0"``, ``"1"``, ...

    Note that slicing (``seq[1:]``) builds a new Sequential over the same
    modules, which renames their parameters (``Parameter.name``) to the new tree.
    """

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> Sequential:
        self.add_module(str(len(self)), module)
        return self

    def __len__(self) -> int:
        return len(self.__dict__["_modules"])

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self.__dict__["_modules"].values()))

    @overload
    def __getitem__(self, idx: int) -> Module: ...

    @overload
    def __getitem__(self, idx: slice) -> Sequential: ...

    def __getitem__(self, idx: int | slice) -> Module | Sequential:
        mods = list(self.__dict__["_modules"].values())
        if isinstance(idx, slice):
            return Sequential(*mods[idx])
        try:
            return mods[idx]
        except IndexError:
            raise IndexError(f"Sequential index {idx} out of range for length {len(mods)}") from None

    def forward(self, x: Array) -> Array:
        for m in self:
            x = m.forward(x)
        return x

    def backward(self, grad_out: Array) -> Array:
        g = grad_out
        for m in reversed(list(self)):
            g = m.backward(g)
        return g
