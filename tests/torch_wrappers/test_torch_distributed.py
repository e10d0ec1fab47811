"""``pp.init_torch_distributed(world)``: a script's own ``torch.distributed`` calls (and torch's own DDP) run
over paramplane. Every rank checks in ``tests/workers/torch_dist.py``."""

from __future__ import annotations

import importlib.util

import pytest
from _world import run_world

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs the test extra (torch, transformers)"
)

# world size -> every rank's env (world 2 on shared memory, world 3 over gRPC)
WORLDS = {2: {"PARAMPLANE_TRANSPORT": "shm"}, 3: {"PARAMPLANE_TRANSPORT": "grpc"}}


@pytest.mark.parametrize("num_ranks", sorted(WORLDS), ids=lambda n: f"world{n}")
def test_torch_distributed_calls_and_torchs_ddp_run_over_the_plane(num_ranks: int) -> None:
    """Every dist collective gives what all ranks' inputs make (sync and async), objects, a new_group, the
    store across ranks; torch's DDP and FSDP2 over the backend train GPT-2 as one process; bad input is a clear error."""
    env = {"PARAMPLANE_TIMEOUT": "30", **WORLDS[num_ranks]}
    out = run_world(num_ranks, "torch_dist.py", env=env, timeout=120)
    out.check_ok(min_checks=54)


def test_a_crashed_rank_fails_the_others_dist_calls_naming_it() -> None:
    """Rank 1 raises after one ``dist.all_reduce``: rank 0's pending async call and its next call fail with
    WorldAborted naming the exception, well before the 60 s group timeout (the harness allows 50 s)."""
    out = run_world(2, "torch_dist.py", args=["crash"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=50)
    assert not out.timed_out, out.describe()
    assert out.ranks[1].returncode == 1 and "bad batch at step 3" in out.ranks[1].output, out.describe()
    survivor = out.ranks[0]
    assert survivor.returncode == 0 and survivor.result is not None, out.describe()
    assert survivor.result["failures"] == [] and survivor.result["num_checks"] == 2, out.describe()
