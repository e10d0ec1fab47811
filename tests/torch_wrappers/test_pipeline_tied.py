"""A weight tied across pipeline stages (GPT-2's embedding and head on the first and last stage) stays
bit-identical at dp 3 under DDP and FSDP (issue 26); the checks run in ``tests/workers/pipeline_tied.py``."""

from __future__ import annotations

import pytest
from _world import run_world

pytest.importorskip("torch")
pytest.importorskip("transformers")

# grpc: the ring's reduce-scatter sums each chunk in another order, which shm and small payloads never do
ENV = {"PARAMPLANE_TIMEOUT": "60", "PARAMPLANE_TRANSPORT": "grpc"}


@pytest.mark.timeout(300)  # its own bound (240 s): 6 ranks on 2 cores
def test_tied_copies_stay_bit_equal_at_dp3_over_the_ring() -> None:
    """pp 2 x dp 3 (6 ranks), the stages wrapped in pp.DDP and then pp.FSDP over dp, three AdamW steps with the
    dp groups' reductions over the ring (transport grpc, the tied weight alone 512 KiB): after every step the
    embedding on the first stage and the head on the last are equal bit for bit, and the losses and the tied
    weight equal one process on the whole batch (float64, 1e-9); a checkpoint with AdamW then saves (the tied
    moments are written once from both stages, which the save refuses where they differ)."""
    run_world(6, "pipeline_tied.py", env=ENV, timeout=240).check_ok(min_checks=20)
