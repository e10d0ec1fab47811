"""Tensor parallel in real worlds: column -> GELU -> row equals the dense MLP (outputs and every gradient,
float64), the gather/split paths too, and a 2 (dp) x 2 (tp) mesh trains exactly like one process."""

from __future__ import annotations

from _world import run_world


def test_tp_mlp_equals_dense() -> None:
    world = run_world(2, "tensor.py", args=["tp"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=120)
    assert all(r["num_checks"] >= 19 for r in world.check_ok())


def test_tp_times_dp_trains_like_one_process() -> None:
    world = run_world(4, "tensor.py", args=["tpdp"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=180)
    assert all(r["num_checks"] >= 6 for r in world.check_ok())


def test_train_tp_example_runs_under_the_launcher() -> None:
    import re
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramplane.cli",
            "launch",
            "--standalone",
            "-n",
            "2",
            "examples/train_tp.py",
            "--epochs",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    match = re.search(r"test accuracy: (\d\.\d+)", proc.stdout)
    assert match and float(match.group(1)) > 0.5, proc.stdout
