"""``pp.SyncBatchNorm``: BatchNorm over the group's whole batch, against one process's plain BatchNorm.

torch's ``SyncBatchNorm`` needs a torch process group; ``pp.convert_sync_batchnorm(model, world.group)`` is its
paramplane form (torchvision's reference scripts' ``--sync-bn``). Without it a BatchNorm model under DDP
normalises each rank's shard alone; with it DDP and FSDP train exactly as one process on the whole batch.
"""

from __future__ import annotations

import importlib.util

import pytest
from _world import run_world

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs the test extra (torch, transformers)"
)


def test_one_layer_with_uneven_batches_equals_one_process() -> None:
    """Outputs, input gradients, running statistics and the summed weight and bias gradients equal one process's
    BatchNorm on the concatenated batch (ranks hold 2 and 3 samples, values far from zero), twice; eval mode and
    a group of one are a plain BatchNorm; bad input is a ValueError."""
    out = run_world(2, "sync_bn.py", args=["layer"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=90)
    out.check_ok(min_checks=18)


@pytest.mark.timeout(210)
def test_resnets_under_ddp_and_fsdp_train_as_one_process_on_the_whole_batch() -> None:
    """torchvision's ResNet-18 under pp.DDP and transformers' ResNet under pp.DDP and pp.FSDP, converted: every
    step's loss, the parameters and the running statistics equal one process with plain BatchNorm on the whole
    batch (float64)."""
    out = run_world(2, "sync_bn.py", args=["train"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=180)
    results = out.check_ok(min_checks=40)
    assert {"resnet/ddp", "resnet/fsdp"} <= set(results[0]["digests"]), "a case did not run"
    assert all(r["digests"] == results[0]["digests"] for r in results), "ranks ended with different states"
