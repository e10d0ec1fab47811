"""pp.DiLoCo (issue 30) in one world of 4 ranks on 2 emulated hosts (tests/workers/diloco.py): H = 1 equals
DDP, H = 4 Nesterov, fragments and overlap equal a single-process simulation step for step (float64, 1e-10),
the fragment schedule and the wire dtypes seen at the group, bounded quantisation error, checkpoint round
trips (plain, FSDP shards, torch), FSDP inside a host and a torch module with torch.optim.Adam inside."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest
from _world import run_world

from paramplane.parallel.diloco_comm import INT8_BLOCK, dequantize_int8, quantize_int8

HOSTS = {0: "hostA", 1: "hostA", 2: "hostB", 3: "hostB"}


def test_int8_blocks_round_trip_within_half_a_step() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(3 * INT8_BLOCK + 17) * np.repeat([1e-3, 1.0, 50.0, 0.0], [256, 256, 256, 17])
    x[-17:] = 0.0  # an all-zero block: scale 0, values 0
    q, scales = quantize_int8(x)
    assert q.dtype == np.int8 and scales.dtype == np.float32 and q.size == 4 * INT8_BLOCK
    back = dequantize_int8(q, scales)[: x.size]
    step = np.repeat(scales, INT8_BLOCK)[: x.size]
    assert np.all(np.abs(back - x) <= step / 2 * (1 + 1e-6) + 1e-12)
    assert np.all(back[-17:] == 0)


@pytest.mark.timeout(200)
def test_diloco_world_4_on_two_hosts() -> None:
    world = run_world(
        4,
        "diloco.py",
        env={"PARAMPLANE_TIMEOUT": "60"},
        rank_env={r: {"PARAMPLANE_HOST_ID": h} for r, h in HOSTS.items()},
        timeout=180,
        heartbeat_timeout_s=30,  # nobody dies here: a rank starved on a loaded machine is not lost
    )
    with_torch = importlib.util.find_spec("torch") is not None  # the torch module under DiLoCo runs too
    results = world.check_ok(min_checks=200 if with_torch else 190)
    assert all(bool(r["values"].get("torch_checked")) == with_torch for r in results)
    errors = results[0]["values"]["wire_errors"]
    assert errors["float16"] < errors["bfloat16"], errors


@pytest.mark.timeout(200)  # its own bounds (150 s), not the global 120 s
@pytest.mark.parametrize(
    ("h", "fragments", "overlap", "steps"), [(4, 1, False, 12), (4, 2, True, 10)], ids=["H4", "streaming"]
)
def test_a_replica_lost_between_syncs_is_replaced_and_training_ends_like_the_simulation(
    h: int, fragments: int, overlap: bool, steps: int
) -> None:
    """Rank 1 exits at the start of step 5 (after the sync of step 4); the survivors notice at the next
    sync, reform, and the replacement gets the last synced state live (tests/workers/diloco_reform.py checks
    every rank's parameters against the simulation at every step after the loss)."""
    env = {"FAIL_AT": "5", "STEPS": str(steps), "H": str(h), "FRAGMENTS": str(fragments)}
    env.update(OVERLAP=str(int(overlap)), VICTIM="1", PARAMPLANE_TIMEOUT="60")
    outcome = run_world(
        4,
        "diloco_reform.py",
        env=env,
        rank_env={r: {"PARAMPLANE_HOST_ID": h} for r, h in HOSTS.items()},
        replace={1: {"PARAMPLANE_HOST_ID": HOSTS[1]}},
        timeout=150,
        heartbeat_timeout_s=5,
    )
    assert [r.returncode for r in outcome.replaced] == [3], outcome.describe()
    results = outcome.check_ok()
    assert all(res["values"]["errors"] for r, res in enumerate(results) if r != 1)
    assert len({res["values"]["resumed_at"] for res in results}) == 1, results
    assert results[0]["digests"], "no state to compare"
    for res in results:  # last, the outer momentum (and after a whole sync the parameters): equal everywhere
        assert res["digests"] == results[0]["digests"], res["rank"]


def _lose_replica_1(mode: str, **env: str) -> tuple[list[Any], list[dict[str, Any]]]:
    """2 replicas x 2 ranks (FSDP full_shard in each host); ranks 2 and 3 (replica 1) are lost and
    replaced (tests/workers/diloco_replica.py). Returns the first processes' outcomes and the results."""
    env = {"MODE": mode, "STEPS": "12", "H": "4", "FRAGMENTS": "1", "OVERLAP": "0", **env}
    outcome = run_world(
        4,
        "diloco_replica.py",
        env={**env, "PARAMPLANE_TIMEOUT": "60"},
        rank_env={r: {"PARAMPLANE_HOST_ID": h} for r, h in HOSTS.items()},
        replace={r: {"PARAMPLANE_HOST_ID": HOSTS[r]} for r in (2, 3)},
        timeout=150,
        heartbeat_timeout_s=5,
    )
    return outcome.replaced, outcome.check_ok()


def _agree_everywhere(results: list[dict[str, Any]], h: int) -> None:
    assert len({res["values"]["resumed_at"] for res in results}) == 1, results
    assert all(res["values"]["errors"] for res in results[:2]), "a survivor never saw the loss"
    # Every rank ends on the same parameters, bit for bit (12 steps: the last one is a whole sync).
    assert len({res["digests"]["end"] for res in results}) == 1, results
    if results[0]["values"]["resumed_at"] % h == 0:  # the rejoin redid a whole sync: equal right after it
        assert len({res["digests"]["after rejoin"] for res in results}) == 1, results


@pytest.mark.timeout(200)  # its own bounds (150 s), not the global 120 s
def test_a_whole_replica_of_two_ranks_lost_between_syncs_gets_the_synced_state_from_the_other() -> None:
    """Both ranks of replica 1 exit at the start of step 5; the replacements (other initial weights) get
    the last synced state over the replicate groups (each shard from its peer shard) and the job ends as the
    simulation in which replica 1 restarts from the sync of step 4 (the worker checks every step)."""
    replaced, results = _lose_replica_1("between", FAIL_AT="5")
    assert [r.returncode for r in replaced] == [3, 3]
    _agree_everywhere(results, 4)


@pytest.mark.timeout(200)  # its own bounds (150 s), not the global 120 s
def test_a_replica_killed_inside_a_sync_leaves_survivors_that_agree() -> None:
    """Ranks 2 and 3 are SIGKILLed inside the outer all-reduce of the sync after step 8 such that rank 0
    received the mean and applied it while rank 1 never got it. rejoin rolls rank 0's sync back, redoes it
    with the replacements, and every rank holds the same parameters, equal to the simulation in which
    replica 1 restarts from the sync of step 4, and training goes on to step 12."""
    replaced, results = _lose_replica_1("in_sync", KILL_SYNC="2")
    assert [r.returncode for r in replaced] == [-9, -9]
    assert [res["values"]["applied_before_rejoin"] for res in results[:2]] == [2, 1]  # the split happened
    assert all(res["values"]["applied"] == 3 for res in results)
    _agree_everywhere(results, 4)


@pytest.mark.timeout(200)  # its own bounds (150 s), not the global 120 s
def test_a_one_rank_survivor_that_trained_past_a_sync_its_peer_died_in_rolls_it_back() -> None:
    """3 replicas of one rank (gRPC between 3 emulated hosts). Rank 2 dies inside sync 2's all-reduce having
    sent its share to rank 0 only: rank 0 applies sync 2 and trains on to step 12 (no collective between
    syncs), where sync 3 fails; rank 1 fails in sync 2 at step 8. rejoin rolls rank 0's sync 2 back keeping
    its 4 steps of progress, redoes syncs 2 and 3 with the replacement, and every rank then equals the
    simulation (tests/workers/diloco_rollback.py) at every step and ends bitwise equal."""
    hosts = {0: "hostA", 1: "hostB", 2: "hostC"}
    outcome = run_world(
        3,
        "diloco_rollback.py",
        env={
            "H": "4",
            "STEPS": "16",
            "KILL_SYNC": "2",
            "PARAMPLANE_TIMEOUT": "60",
            "PARAMPLANE_TRANSPORT": "grpc",
        },
        rank_env={r: {"PARAMPLANE_HOST_ID": h} for r, h in hosts.items()},
        replace={2: {"PARAMPLANE_HOST_ID": hosts[2]}},
        timeout=150,
        heartbeat_timeout_s=5,
    )
    assert [r.returncode for r in outcome.replaced] == [-9], outcome.describe()
    results = outcome.check_ok()
    survivors = [res["values"] for res in results[:2]]
    assert [v["applied_before_rejoin"] for v in survivors] == [2, 1], survivors  # the split happened
    assert [v["failed_at"] for v in survivors] == [12, 8], survivors  # rank 0 trained on past sync 2
    assert [res["values"]["resumed_at"] for res in results] == [12, 8, 12], results
    assert all(res["values"]["applied"] == 4 for res in results), results
    assert len({res["digests"]["end"] for res in results}) == 1, results
