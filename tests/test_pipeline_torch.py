"""Pipelines of torch modules (issue 26): ``pp.pipeline_split`` of transformers GPT-2 and Llama and the
project's torch GPT, every schedule, equal to one process; the checks run in ``tests/workers/pipeline_torch.py``."""

from __future__ import annotations

import pytest
from _world import run_world

pytest.importorskip("torch")
pytest.importorskip("transformers")

ENV = {"PARAMPLANE_TIMEOUT": "60"}


@pytest.mark.timeout(300)  # its own bound (240 s): one world of 2 ranks, seven pipelines
def test_torch_stages_equal_one_process_under_every_schedule() -> None:
    """pp 2, every schedule: three AdamW steps of GPT-2 and the project's GPT (and Llama under interleaved
    1F1B) cut by ``pipeline_split``; every step's loss and gradients and the final parameters equal one process
    on the whole batch (float64 1e-9; Llama 1e-5 for its float32 internals), the attention mask (which changes
    the loss here) reaches every stage, and the tied embedding/head weight is the same on the first and the
    last stage. Then a stage given to the wrong rank and bad boundaries are ValueErrors."""
    out = run_world(2, "pipeline_torch.py", env=ENV, timeout=240).check_ok(min_checks=300)
    tied = out[0]["values"]["tied"]
    assert len(tied) == 7 and all(len(d) == 1 for d in tied.values())
    assert tied == out[1]["values"]["tied"]
