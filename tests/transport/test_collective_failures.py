"""Failure handling of the data plane in real multi-process worlds (DESIGN.md, Failure model).

Workers live in tests/workers/failures.py; each world runs one scenario with many checks.
"""

from __future__ import annotations

import pytest
from _world import WorldOutcome, run_world

HEARTBEAT_TIMEOUT_S = 3.0
TRANSPORTS = ["grpc", "shm"]


@pytest.fixture(scope="module", params=TRANSPORTS)
def errors_world(request: pytest.FixtureRequest) -> tuple[str, WorldOutcome]:
    """One 2-rank world (PARAMPLANE_TIMEOUT=2) per transport running the "errors" scenario."""
    world = run_world(
        2,
        "failures.py",
        args=["errors"],
        env={"PARAMPLANE_TRANSPORT": request.param, "PARAMPLANE_TIMEOUT": "2"},
        timeout=60,
    )
    assert not world.timed_out, world.describe()
    assert all(r.returncode == 0 and r.result is not None for r in world.ranks), world.describe()
    return request.param, world


def failures(world: WorldOutcome, topic: str) -> list[str]:
    """The failed checks of ``topic`` on every rank (asserting each rank ran some of them)."""
    found = []
    for r in world.ranks:
        assert r.result is not None
        unexpected = [f for f in r.result["failures"] if f.startswith("unexpected")]
        assert not unexpected, unexpected
        found += [f"rank {r.rank}: {f}" for f in r.result["failures"] if f.startswith(f"{topic}:")]
    return found


def test_bad_input_raises_value_error_before_any_communication(
    errors_world: tuple[str, WorldOutcome],
) -> None:
    """Non-contiguous, read-only, non-array input, unknown op or root: ValueError on one rank
    alone, and the group's next op still pairs up (no sequence number was consumed)."""
    assert failures(errors_world[1], "input") == []
    assert errors_world[1].ranks[0].result is not None
    assert errors_world[1].ranks[0].result["num_checks"] >= 8


def test_work_wait_timeout_leaves_the_op_running(errors_world: tuple[str, WorldOutcome]) -> None:
    assert failures(errors_world[1], "work") == []


def test_mismatched_shapes_fail_both_ranks(errors_world: tuple[str, WorldOutcome]) -> None:
    _transport, world = errors_world
    assert failures(world, "mismatch") == []
    for r in world.ranks:
        assert r.result is not None
        text = r.result["values"]["mismatch_text"]
        assert "rank 0" in text and "rank 1" in text, text


def test_group_timeout_with_a_rank_that_never_calls(errors_world: tuple[str, WorldOutcome]) -> None:
    world = errors_world[1]
    assert failures(world, "timeout") == []
    assert world.ranks[0].result is not None
    elapsed = world.ranks[0].result["values"]["timeout_elapsed"]
    # No upper bound tighter than the harness needs: a busy machine may be seconds late, a missing timeout never ends.
    assert 1.9 <= elapsed < 20.0, f"group timeout of 2 s raised after {elapsed:.2f} s"


def test_work_of_a_failed_op_reraises_its_error(errors_world: tuple[str, WorldOutcome]) -> None:
    assert failures(errors_world[1], "work-error") == []


def test_ops_after_shutdown_raise_plane_closed(errors_world: tuple[str, WorldOutcome]) -> None:
    assert failures(errors_world[1], "closed") == []


def test_failed_groups_leave_nothing_in_dev_shm(errors_world: tuple[str, WorldOutcome]) -> None:
    assert errors_world[1].shm_leaks() == set()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_rank_killed_mid_all_reduce_gives_peer_lost(transport: str) -> None:
    """Rank 2 exits with os._exit inside a large all_reduce; ranks 0 and 1 get PeerLost naming it
    within the coordinator's heartbeat timeout plus 2 s (on shm, from shm's own liveness check), and
    nothing stays in /dev/shm."""
    world = run_world(
        3,
        "failures.py",
        args=["peer-lost"],
        env={"PARAMPLANE_TRANSPORT": transport, "PARAMPLANE_TIMEOUT": "60"},
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        heartbeat_interval_s=0.5,
        timeout=60,
    )
    assert not world.timed_out, world.describe()
    dead = world.ranks[2]
    assert dead.returncode == 17, world.describe()
    assert dead.result is not None and "died_at" in dead.result["values"], world.describe()
    died_at = dead.result["values"]["died_at"]
    for survivor in world.ranks[:2]:
        assert survivor.returncode == 0, world.describe()
        assert survivor.result is not None and survivor.result["failures"] == [], world.describe()
        values = survivor.result["values"]
        assert values["error_type"] == "PeerLost", values
        assert values["error_rank"] == 2, values
        assert "rank 2" in values["error_text"], values
        if transport == "shm":
            # Seen by shm itself, not the coordinator: rank 2 is an unreaped zombie here (the harness waits
            # for ranks in order), whose pid still answers kill(pid, 0) but whose liveness lock is gone.
            assert "died during a shared-memory collective" in values["error_text"], values
        delay = values["error_at"] - died_at
        assert delay < HEARTBEAT_TIMEOUT_S + 10.0, (  # slack for ranks oversubscribing 2 busy cores
            f"rank {survivor.rank} learned of the death after {delay:.2f} s"
        )
    assert world.shm_leaks() == set()


def test_malformed_frame_and_missing_token() -> None:
    """A garbage FrameHeader after a valid StreamOpen fails the target's pending op with
    TransportError (nothing hangs); calls without the token are UNAUTHENTICATED."""
    world = run_world(
        2,
        "failures.py",
        args=["malformed"],
        env={"PARAMPLANE_TRANSPORT": "grpc", "PARAMPLANE_TIMEOUT": "30"},
        token="test-token-5f2a",
        timeout=60,
    )
    results = world.check_ok(min_checks=1)
    assert results[0]["values"]["fail_elapsed"] < 20.0  # the group timeout is 30 s
    assert all("test-token-5f2a" not in r.output for r in world.ranks)


def test_dead_sender_detected_by_its_stream_breaking() -> None:
    """With a long heartbeat timeout, a rank that only receives from a dead rank must learn of
    the death from the data stream breaking, not from the coordinator."""
    heartbeat_timeout_s = 20.0
    world = run_world(
        2,
        "failures.py",
        args=["sender-dies"],
        env={"PARAMPLANE_TRANSPORT": "grpc", "PARAMPLANE_TIMEOUT": "60"},
        heartbeat_timeout_s=heartbeat_timeout_s,
        timeout=60,
    )
    assert not world.timed_out, world.describe()
    dead, survivor = world.ranks[1], world.ranks[0]
    assert dead.returncode == 17 and dead.result is not None, world.describe()
    assert survivor.result is not None and survivor.result["failures"] == [], world.describe()
    assert survivor.result["values"]["error_type"] == "PeerLost", survivor.result["values"]
    assert survivor.result["values"]["error_rank"] == 1, survivor.result["values"]
    delay = survivor.result["values"]["error_at"] - dead.result["values"]["died_at"]
    # Well before the heartbeat timeout could have told it, with slack for a busy machine.
    assert delay < 10.0, f"rank 0 learned of rank 1's death after {delay:.2f} s"


def test_oversized_message_is_refused_and_fails_the_pending_op() -> None:
    """A message over the data plane's size limit is refused (RESOURCE_EXHAUSTED) and the target's
    pending op fails with TransportError saying so, instead of waiting or blaming a lost peer."""
    world = run_world(
        2,
        "failures.py",
        args=["oversized"],
        env={"PARAMPLANE_TRANSPORT": "grpc", "PARAMPLANE_TIMEOUT": "30"},
        token="test-token-9c1d",
        timeout=60,
    )
    world.check_ok(min_checks=1)
