"""In-process recovery: ``world.reform()`` after a lost rank, a replacement that receives state live
(``pp.checkpoint.sync``), and training that ends exactly like a run that never failed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._world import WORKERS, run_world

STEPS = 6


def _train(
    fail_at: int, *, replace: bool, transport: str, worker: str = "reform.py"
) -> list[dict[str, object]]:
    outcome = run_world(
        3,
        worker,
        env={"FAIL_AT": str(fail_at), "STEPS": str(STEPS), "PARAMPLANE_TRANSPORT": transport},
        replace={1: {}} if replace else None,
        timeout=120,
        heartbeat_timeout_s=5,
    )
    if replace:
        (first,) = outcome.replaced
        assert first.returncode == 3, outcome.describe()  # the victim did die at FAIL_AT
    return outcome.check_ok()


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
@pytest.mark.parametrize(
    ("transport", "worker"),
    [
        ("auto", "reform.py"),  # shm on one host
        ("grpc", "reform.py"),  # the inter-host path
        # a torch loop: GPT-2 under pp.DDP, torch's AdamW through ddp.optim_state(opt)
        pytest.param(
            "auto",
            "reform_torch.py",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("transformers") is None, reason="needs the test extra"
            ),
        ),
    ],
)
def test_a_replacement_rank_receives_state_live_and_training_ends_like_an_unbroken_run(
    transport: str, worker: str
) -> None:
    clean = _train(-1, replace=False, transport=transport, worker=worker)
    broken = _train(3, replace=True, transport=transport, worker=worker)
    for r in (0, 2):
        assert broken[r]["values"]["errors"], f"survivor {r} never saw the loss"  # type: ignore[index]
        assert broken[r]["values"]["resumed_at"] == 3  # type: ignore[index]
    assert broken[1]["values"]["resumed_at"] == 3  # type: ignore[index]
    assert {res["values"]["epoch"] for res in broken} == {2}  # type: ignore[index]
    assert [res["values"]["rank_after"] for res in broken] == [0, 1, 2]  # type: ignore[index]
    # Every rank holds the same parameters and optimizer state, bit for bit, and they are the ones an
    # unbroken run reaches (the replacement started from other weights: only the live transfer fixes that).
    assert clean[0]["digests"], "no state to compare"
    for res in broken:
        assert res["digests"] == clean[0]["digests"], res["rank"]
    assert all(res["digests"] == clean[0]["digests"] for res in clean)
    assert any(k.startswith("optim ") for k in clean[0]["digests"])  # type: ignore[union-attr]


@pytest.mark.timeout(210)  # its own bounds (150 s), not the global 120 s
@pytest.mark.parametrize(
    "worker",
    [
        "reform.py",
        # a torch loop: GPT-2 under pp.FSDP hybrid_shard, torch's AdamW through fsdp.optim_state(opt)
        pytest.param(
            "reform_torch.py",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("transformers") is None, reason="needs the test extra"
            ),
        ),
    ],
)
def test_a_hybrid_shard_replacement_gets_its_shards_from_its_replica_and_ends_like_an_unbroken_run(
    worker: str,
) -> None:
    """HybridShard over two "hosts" (2 x 2): rank 1 dies; its replica on the other host (rank 3) sends the
    replacement its parameter and optimizer shards over the replicate group; fsdp.reform() on survivors."""
    hosts = {r: {"PARAMPLANE_HOST_ID": "ab"[r // 2]} for r in range(4)}

    def train(fail_at: int) -> list[dict[str, object]]:
        outcome = run_world(
            4,
            worker,
            env={"FAIL_AT": str(fail_at), "STEPS": str(STEPS), "WRAPPER": "hybrid_shard"},
            rank_env=hosts,
            replace={1: hosts[1]} if fail_at >= 0 else None,
            timeout=150,
            heartbeat_timeout_s=5,
        )
        if fail_at >= 0:
            assert [r.returncode for r in outcome.replaced] == [3], outcome.describe()
        return outcome.check_ok()

    clean, broken = train(-1), train(3)
    assert broken[1]["values"]["resumed_at"] == 3  # type: ignore[index]
    assert all(broken[r]["values"]["errors"] for r in (0, 2, 3))  # type: ignore[index]
    assert {res["values"]["epoch"] for res in broken} == {2}  # type: ignore[index]
    assert clean[0]["digests"], "no state to compare"
    for res in [*clean, *broken]:
        assert res["digests"] == clean[0]["digests"], res["rank"]


def test_sync_refuses_state_that_does_not_fit_on_every_rank_and_modifies_nothing() -> None:
    """No rank with state, a different model, and a different layout: CheckpointError on every rank, naming
    the problem, before anything is modified (the checks are in tests/workers/reform_errors.py)."""
    results = run_world(2, "reform_errors.py", timeout=60).check_ok()
    assert all(res["num_checks"] >= 7 for res in results)


@pytest.mark.timeout(240)  # its own bounds (180 s), not the global 120 s
def test_launch_max_replacements_replaces_the_lost_rank_while_the_others_go_on(tmp_path: Path) -> None:
    env = dict(os.environ, FAIL_AT="3", STEPS=str(STEPS), PARAMPLANE_TEST_OUT=str(tmp_path))
    cmd = [sys.executable, "-m", "paramplane.cli", "launch", "--standalone", "-n", "3"]
    cmd += ["--heartbeat-timeout", "5", "--timeout", "60", "--max-replacements", "1"]
    proc = subprocess.run(
        [*cmd, str(WORKERS / "reform.py")], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 1 exited with code 3; starting a replacement (replacement 1 of 1)" in proc.stderr
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    assert all(res["failures"] == [] for res in results), results
    assert [res["values"]["epoch"] for res in results] == [2, 2, 2]
    assert results[0]["digests"] == results[1]["digests"] == results[2]["digests"]
