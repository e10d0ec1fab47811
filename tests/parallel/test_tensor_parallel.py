"""Tensor parallel in real worlds: column -> GELU -> row equals the dense MLP (outputs and every gradient,
float64), the gather/split paths too, and a 2 (dp) x 2 (tp) mesh trains exactly like one process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _world import run_example, run_world

from paramplane.node.arrays import cupy_module


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_tp_mlp_equals_dense() -> None:
    world = run_world(2, "tensor.py", args=["tp"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=120)
    assert all(r["num_checks"] >= 22 + 14 for r in world.check_ok())


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
def test_tp_times_dp_trains_like_one_process_and_checkpoints_the_dense_model(tmp_path: Path) -> None:
    world = run_world(
        4, "tensor.py", args=["tpdp", str(tmp_path)], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=180
    )
    assert all(r["num_checks"] >= 17 + 28 for r in world.check_ok())


def test_train_tp_example_runs_under_the_launcher() -> None:
    out = run_example("train_tp.py", 2, "--epochs", "2")
    match = re.search(r"test accuracy: (\d\.\d+)", out)
    assert match and float(match.group(1)) > 0.5, out


@pytest.mark.timeout(360)  # its own bounds (300 s), not the global 120 s
@pytest.mark.gpu
@pytest.mark.skipif(cupy_module() is None, reason="cupy finds no CUDA device")
def test_tp_mlp_on_cupy_with_nccl() -> None:
    """The TP MLP on cupy arrays equals the dense numpy MLP (outputs, every gradient, both comm paths)."""
    cupy = cupy_module()
    assert cupy is not None
    world = run_world(2, "tensor_gpu.py", env={"PARAMPLANE_TIMEOUT": "120"}, timeout=300)
    assert all(r["num_checks"] >= 24 for r in world.check_ok())
