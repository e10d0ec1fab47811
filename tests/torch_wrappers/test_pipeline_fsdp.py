"""FSDP over data-parallel replicas inside a pipeline of torch stages (issue 26): dp 2 x pp 2 equal to one
process (the checks run in ``tests/workers/pipeline_fsdp.py``), and the 3-D example with ``--dp-wrapper fsdp``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from _world import run_example, run_world

pytest.importorskip("torch")
pytest.importorskip("transformers")

ENV = {"PARAMPLANE_TIMEOUT": "60"}


@pytest.mark.timeout(420)  # its own bound (360 s): 4 ranks, ~150 s on 2 cores at load 9
def test_fsdp_stages_equal_one_process_with_one_reduction_per_step() -> None:
    """GPT-2 (float64, tied embedding/head on the first and last stage) cut into pp 2 stages, each wrapped in
    ``pp.FSDP`` over dp 2: GPipe (a unit per block), 1F1B (default units) and interleaved 1F1B, two AdamW steps
    with clipping; every step's loss and gradient norm and the final parameters equal one process on the whole
    batch (1e-9), with one reduce-scatter per unit per step however many microbatches."""
    run_world(4, "pipeline_fsdp.py", env=ENV, timeout=360).check_ok(min_checks=40)


def _steps(out: str) -> list[float]:
    """Loss and grad norm of each ``step i/n: loss L grad norm G`` line the example printed, in order."""
    found = re.findall(r"step \d+/\d+: loss ([0-9.]+) grad norm ([0-9.]+)", out)
    return [float(x) for pair in found for x in pair]


@pytest.mark.timeout(780)  # four launches of 4 ranks, each bounded by run_example's 180 s
def test_example_fsdp_over_dp_trains_as_ddp(tmp_path: Path) -> None:
    """``examples/train_gpt_3d.py --dp-wrapper fsdp`` at dp 2 x pp 2 (the smallest world where FSDP shards a
    pipeline stage) prints the same losses and clipped gradient norms, step by step, as the same run with
    ``pp.DDP`` over dp (float32: equal to 1e-4), and both learn. Their step-2 checkpoints (AdamW state saved
    under the dense model's keys, the tied embedding/head's once) resume across wrappers and splits as the
    uninterrupted run: the FSDP one at dp 2 x pp 1 x tp 2 into FSDP over tensor-parallel stages (the moments
    loaded as pieces of the dense arrays), the DDP one into FSDP stages at dp 2 x pp 2 (the tied moments taken
    back into two different shardings); step 4's loss depends on the restored AdamW moments and step count."""
    runs = {}
    for wrapper in ("ddp", "fsdp"):
        args = ["--dp", "2", "--pp", "2", "--tp", "1", "--steps", "4", "--dp-wrapper", wrapper]
        out = run_example(
            "train_gpt_3d.py",
            4,
            *args,
            "--checkpoint-every",
            "2",
            "--checkpoint-dir",
            str(tmp_path / wrapper),
            timeout=180,
        )
        runs[wrapper] = _steps(out)
    assert len(runs["ddp"]) == len(runs["fsdp"]) == 8, runs
    assert runs["fsdp"] == pytest.approx(runs["ddp"], rel=1e-4), runs
    assert runs["fsdp"][-2] < runs["fsdp"][0] - 0.1, runs
    for saved, split in (
        ("fsdp", ["--pp", "1", "--tp", "2", "--dp-wrapper", "fsdp"]),
        ("ddp", ["--pp", "2", "--dp-wrapper", "fsdp"]),
    ):
        shutil.rmtree(tmp_path / saved / "step_000004")
        args = ["--dp", "2", "--tp", "1", *split, "--steps", "4", "--resume"]
        out = run_example("train_gpt_3d.py", 4, *args, "--checkpoint-dir", str(tmp_path / saved), timeout=180)
        assert "at step 2" in out, out
        assert _steps(out) == pytest.approx(runs[saved][4:], rel=1e-4), (saved, _steps(out), runs)
