"""``pp.ShardedGradScaler``: float16 loss scaling whose skipped steps agree across the ranks of a sharded model.

torch's ``GradScaler`` checks this rank's gradients only; under pp.FSDP an overflow lands in one rank's shard, so
the ranks would skip different steps. Compared with one process using torch's scaler on the whole batch.
"""

from __future__ import annotations

import importlib.util

import pytest
from _world import run_world

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs the test extra (torch, transformers)"
)


def test_an_overflow_in_one_shard_skips_the_step_on_every_rank_as_one_process() -> None:
    """GPT-2 under full_shard, world 2: an overflow in one gradient element at step 1 parts the ranks' scales with
    torch's own scaler (checked), while with pp.ShardedGradScaler the scale, every step's loss and the final
    parameters equal one process with torch's scaler (float64, 1e-9); a scaler without a group is refused."""
    out = run_world(2, "grad_scaler.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=120)
    results = out.check_ok(min_checks=5)
    assert results[0]["digests"] == results[1]["digests"], "ranks ended with different parameters"
