"""3-D parallel training of a torch transformer (issue 26): dp x pp x tp on one mesh equal to one process, and
a checkpoint saved at one factorisation loaded at another; the checks run in ``tests/workers/pipeline_3d.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from _world import run_world

pytest.importorskip("torch")
pytest.importorskip("transformers")

ENV = {"PARAMPLANE_TIMEOUT": "120"}


@pytest.mark.timeout(560)  # its own bounds (180 s + 300 s): 8 ranks oversubscribe the CI's 2 cores
def test_3d_training_equals_one_process_and_checkpoints_move_between_factorisations(tmp_path: Path) -> None:
    """GPT-2 (4 blocks, float64) trained three AdamW steps with clipping at dp 1 x pp 2 x tp 2 (4 ranks), then
    at dp 2 x pp 2 x tp 2 (8 ranks): every step's loss and clipped gradient norm and the final dense parameters
    equal one process on the whole batch (relative 1e-9). The 8-rank world then loads the 4-rank world's
    checkpoint into a fresh model at dp 1 x pp 4 x tp 2 and gets the reference parameters."""
    small = tmp_path / "ckpt_1x2x2"
    run_world(4, "pipeline_3d.py", args=["1", "2", "2", str(small)], env=ENV, timeout=180).check_ok(
        min_checks=30
    )
    args = ["2", "2", "2", str(tmp_path / "ckpt_2x2x2"), str(small), "1", "4", "2"]
    run_world(8, "pipeline_3d.py", args=args, env=ENV, timeout=300).check_ok(min_checks=40)
