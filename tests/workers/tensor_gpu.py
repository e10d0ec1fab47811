"""Tensor parallel on cupy arrays (NCCL): the column -> GELU -> row MLP equals the dense numpy MLP in
outputs and every gradient, both comm paths, and full_weight / load_full_weight stay on the device."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Report, run_rank
from tensor import D, H, dense_mlp

import paramplane as pp
from paramplane.nn import GELU, Sequential

RTOL = 1e-10


def scenario(world: Any, rep: Report) -> None:
    import cupy

    world.use_gpu()
    g = world.group
    r, k = g.rank, H // g.size
    x = np.random.default_rng(1).standard_normal((4, 3, D))
    grad_y = np.random.default_rng(2).standard_normal((4, 3, D))
    dense = dense_mlp()
    y_dense = dense.forward(x)
    gx_dense = dense.backward(grad_y)
    for name, col, row in (
        ("parallel", {}, {}),
        ("gathered", {"gather_output": True}, {"input_is_parallel": False}),
    ):
        model = Sequential(
            pp.ColumnParallelLinear(D, H, g, dtype=np.float64, rng=5, xp=cupy, **col),
            GELU(),
            pp.RowParallelLinear(H, D, g, dtype=np.float64, rng=6, xp=cupy, **row),
        )
        y = model.forward(cupy.asarray(x))
        rep.check(f"{name}: output on the device", isinstance(y, cupy.ndarray), type(y).__name__)
        rep.equal(f"{name}: output", cupy.asnumpy(y), y_dense, rtol=RTOL)
        rep.equal(
            f"{name}: input grad", cupy.asnumpy(model.backward(cupy.asarray(grad_y))), gx_dense, rtol=RTOL
        )
        rep.equal(
            f"{name}: col weight grad",
            cupy.asnumpy(model[0].weight.grad),
            dense[0].weight.grad[r * k : (r + 1) * k],
            rtol=RTOL,
        )
        rep.equal(
            f"{name}: row weight grad",
            cupy.asnumpy(model[2].weight.grad),
            dense[2].weight.grad[:, r * k : (r + 1) * k],
            rtol=RTOL,
        )
        rep.equal(f"{name}: row bias grad", cupy.asnumpy(model[2].bias.grad), dense[2].bias.grad, rtol=RTOL)
        for i in (0, 2):
            w, b = model[i].full_weight()
            rep.check(f"{name}: full weight {i} on the device", isinstance(w, cupy.ndarray), type(w).__name__)
            rep.equal(f"{name}: full weight {i}", cupy.asnumpy(w), dense[i].weight.data)
            model[i].load_full_weight(w * 2, b * 2)
            rep.equal(
                f"{name}: loaded weight {i}",
                cupy.asnumpy(model[i].full_weight()[0]),
                dense[i].weight.data * 2,
            )


if __name__ == "__main__":
    run_rank(scenario)
