"""Pipeline stages loading their own part of a checkpoint (issue 26); the checks run in
``tests/workers/pipeline_ckpt.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from _world import run_world

pytest.importorskip("torch")
pytest.importorskip("transformers")

ENV = {"PARAMPLANE_TIMEOUT": "60"}


@pytest.mark.timeout(300)  # its own bound (240 s): one world of 2 ranks
def test_stages_load_their_part_at_another_split_and_continue_as_one_process(tmp_path: Path) -> None:
    """GPT-2 saved by a pp 2 pipeline (cut at block 1) after two AdamW steps, with its optimizer state
    (``pipe.optim_state``: the dense model's keys, the tied embedding/head once), and a dense save of one
    process (``pp.tp_optim_state``), load straight into the stages of other splits and fresh AdamWs
    (``pp.pipeline_optim_state``): pp 1 (FSDP over dp 2), pp 2 cut at block 3, and the dense save at pp 2 cut at
    block 2. Steps three and four (losses, final parameters) equal the unbroken one-process run (float64 1e-9),
    the step count is restored, and each stage read only its own keys (the rest of the model kept its fresh
    values)."""
    run_world(2, "pipeline_ckpt.py", args=[str(tmp_path)], env=ENV, timeout=240).check_ok(min_checks=60)


@pytest.mark.timeout(300)  # its own bound (240 s): one world of 4 ranks
def test_fsdp_over_tensor_parallel_stages_saves_adamw_as_the_dense_model(tmp_path: Path) -> None:
    """GPT-2 as one stage split over tp 2 and wrapped in ``pp.FSDP`` over dp 2 (3-D with FSDP, 4 ranks) saves
    AdamW's state through ``pipe.optim_state`` as the dense model's arrays (the one-process save's keys and
    shapes): it loads at dp 2 x pp 2 under ``pp.DDP``, a one-process save loads into FSDP over tp 2 stages, and
    both continue (steps three and four, losses and final parameters) as the unbroken one-process run
    (float64 1e-9) with the step count restored."""
    run_world(4, "pipeline_ckpt_tp.py", args=[str(tmp_path)], env=ENV, timeout=240).check_ok(min_checks=60)
