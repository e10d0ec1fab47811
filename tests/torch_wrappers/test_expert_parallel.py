"""Expert parallel for torch mixtures of experts: ``pp.parallelize(model, group, {"*mlp.experts": "experts"})``
under ``pp.DDP`` over the same group (each rank checks in ``tests/workers/expert_parallel.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _world import run_world

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
def test_mixtral_experts_split_over_two_ranks_train_as_one_process(tmp_path: Path) -> None:
    world = run_world(
        2, "expert_parallel.py", args=["train", str(tmp_path)], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=180
    )
    counts = [r["num_checks"] for r in world.check_ok()]
    assert min(counts) >= 150, counts
