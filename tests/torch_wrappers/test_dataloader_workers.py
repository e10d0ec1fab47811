"""torch's DataLoader with worker processes inside ranks: what nearly every training script does.

A worker forked by a rank used to segfault (gRPC's fork handlers, grpc/grpc#32992: paramplane now turns them off);
a worker started with "spawn" from a script without a main guard gets an error naming the guard.
"""

from __future__ import annotations

import importlib.util

import pytest
from _world import run_world

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs the test extra (torch, transformers)"
)


def test_forked_dataloader_workers_run_beside_the_ranks_grpc_threads() -> None:
    """GPT-2 under pp.DDP at world 2 reads 6 epochs through DataLoaders of 2 forked workers each (a
    DistributedSampler told the world): no worker dies, and every loss and the final parameters equal one
    process on both ranks' batches."""
    out = run_world(2, "dataloader_workers.py", args=["fork"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=150)
    results = out.check_ok(min_checks=3)
    assert results[0]["digests"] == results[1]["digests"], "ranks ended with different parameters"
    assert not any("Segmentation fault" in r.output for r in out.ranks), out.describe()


def test_a_spawned_worker_of_a_script_without_a_main_guard_is_told_to_add_one() -> None:
    """The script calls pp.init() at its top level; its DataLoader's "spawn" worker runs that again and is refused
    with a RendezvousError naming ``if __name__ == "__main__":`` (it used to try joining as its parent's rank:
    "world is full"); the rank's DataLoader raises and the world stays usable."""
    out = run_world(2, "dataloader_workers.py", args=["spawn"], env={"PARAMPLANE_TIMEOUT": "30"}, timeout=150)
    out.check_ok(min_checks=2)
    text = "".join(r.output for r in out.ranks)
    assert "RendezvousError" in text and 'if __name__ == "__main__":' in text, text[-3000:]
    assert "world is full" not in text, text[-3000:]
