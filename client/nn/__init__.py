"""Reference neural-network modules with explicit backward (numpy and cupy).

A module's ``forward(x)`` caches what its ``backward(grad_out)`` needs;
``backward`` accumulates parameter gradients through
:meth:`Parameter.accumulate_grad` (firing the gradient hooks DDP uses) and
returns the input gradient. See :mod:`paramplane.nn.module` for the protocol.
"""

from __future__ import annotations

from paramplane.nn.attention import MultiHeadAttention
from paramplane.nn.layers import (
    GELU,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    ReLU,
    RngLike,
    Sequential,
    make_rng,
)
from paramplane.nn.loss import CrossEntropyLoss, Loss, MSELoss
from paramplane.nn.module import Array, LoadResult, Module, Parameter, RemovableHandle

__all__ = [
    "GELU",
    "Array",
    "CrossEntropyLoss",
    "Dropout",
    "Embedding",
    "LayerNorm",
    "Linear",
    "LoadResult",
    "Loss",
    "MSELoss",
    "Module",
    "MultiHeadAttention",
    "Parameter",
    "ReLU",
    "RemovableHandle",
    "RngLike",
    "Sequential",
    "make_rng",
]
