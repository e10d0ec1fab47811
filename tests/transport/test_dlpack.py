"""Collectives and checkpoints accept any __dlpack__ tensor (torch CPU here) zero-copy, in place where the op is in place."""

from __future__ import annotations

import pytest
from _world import run_world

pytest.importorskip("torch")


def test_torch_tensors_through_collectives() -> None:
    world = run_world(2, "dlpack.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90)
    assert all(r["num_checks"] >= 17 for r in world.check_ok())


def test_ddp_over_a_torch_module_matches_one_process_on_the_whole_batch() -> None:
    """pp.DDP wraps a torch.nn.Module: broadcast at wrap, gradient buckets from torch's grad hooks, a torch
    optimizer attached; every step equals single-process training (checked on each rank in the worker)."""
    results = run_world(2, "torch_ddp.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90).check_ok()
    assert all(r["num_checks"] >= 3 * 6 + 3 for r in results)
    assert results[0]["digests"] == results[1]["digests"]


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_fsdp_over_a_torch_module_matches_one_process_on_the_whole_batch() -> None:
    """pp.FSDP wraps a torch.nn.Module: full_shard, shard_grad_op and no_shard with a torch AdamW on this
    rank's shards equal single-process training after every step (no_sync accumulation and clipping
    included); collective counts, resharding, sharded optimizer state, state dicts, a checkpoint round
    trip, bfloat16 mixed precision and the errors are checked on each rank in the worker."""
    results = run_world(2, "torch_fsdp.py", env={"PARAMPLANE_TIMEOUT": "30"}, timeout=120).check_ok()
    assert all(r["num_checks"] >= 99 for r in results)  # 30-31 per strategy, 4 mixed precision, 4 errors
    assert results[0]["digests"] == results[1]["digests"]
