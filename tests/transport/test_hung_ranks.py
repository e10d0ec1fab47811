"""A rank that hangs (SIGSTOP) is named to every survivor within the heartbeat timeout; world.abort(reason)
reaches every other rank with the reason. End to end: real processes, coordinator, runtime."""

from __future__ import annotations

import pytest
from _world import run_world


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_a_stopped_rank_is_named_to_every_survivor() -> None:
    world = run_world(
        3,
        "hung.py",
        args=["sigstop"],
        env={"PARAMPLANE_TIMEOUT": "60"},
        heartbeat_timeout_s=2.0,
        heartbeat_interval_s=0.2,
        timeout=120,
    )
    results = world.check_ok()
    stopped_at = results[1]["values"]["stopped_at"]
    for r in (0, 2):
        v = results[r]["values"]
        assert v["error"] == "PeerLost" and v["rank"] == 1 and "rank 1" in v["message"], v
        assert "missed heartbeats" in v["message"], v
        assert v["at"] - stopped_at < 2.0 + 15, v  # the heartbeat timeout, with slack for a busy machine


def test_world_abort_reaches_every_rank_with_its_reason() -> None:
    world = run_world(3, "hung.py", args=["abort"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=90)
    results = world.check_ok()
    for r in (0, 1, 2):
        v = results[r]["values"]
        assert v["error"] == "WorldAborted" and "loss became NaN at step 7" in v["message"], v


def test_a_rank_that_aborts_and_exits_at_once_still_gives_every_rank_its_reason() -> None:
    """Its peers, waiting on it in an all_reduce over shared memory, may find it dead before the abort's notice
    arrives; they ask the coordinator, which has the abort, and fail with WorldAborted and the reason."""
    for _ in range(3):  # the race goes either way; each round must end with the reason
        world = run_world(3, "hung.py", args=["abort_exit"], env={"PARAMPLANE_TIMEOUT": "60"}, timeout=90)
        results = world.check_ok()
        for r in (0, 1):
            v = results[r]["values"]
            assert v["error"] == "WorldAborted" and "loss became NaN at step 7" in v["message"], v


@pytest.mark.timeout(180)  # its own bounds (120 s), not the global 120 s
def test_a_rank_that_stops_issuing_collectives_is_named() -> None:
    world = run_world(
        3,
        "hung.py",
        args=["stall"],
        env={"PARAMPLANE_TIMEOUT": "60"},
        heartbeat_interval_s=0.2,
        progress_timeout_s=2.0,
        timeout=120,
    )
    results = world.check_ok()
    stalled_at = results[1]["values"]["stalled_at"]
    for r in (0, 2):
        v = results[r]["values"]
        assert v["error"] == "PeerLost" and v["rank"] == 1 and "made no progress" in v["message"], v
        assert v["at"] - stalled_at < 2.0 + 15, v


@pytest.mark.parametrize("how", ["with", "uncaught", "finally"])
def test_a_rank_whose_script_raises_aborts_the_world_with_the_exception(how: str) -> None:
    """Rank 1 dies of a ValueError (leaving ``with pp.init()``, uncaught without it, or through a ``finally``
    that calls ``world.shutdown()``, as the examples do) while rank 0 waits for
    its message: rank 0 fails with WorldAborted naming the exception, not after its 120 s group timeout (the
    harness kills the ranks after 60 s)."""
    world = run_world(2, "crash.py", args=[how], env={"PARAMPLANE_TIMEOUT": "120"}, timeout=60)
    assert not world.timed_out, world.describe()
    crashed = world.ranks[1]
    assert crashed.returncode == 1 and "ValueError: bad batch at step 3" in crashed.output, world.describe()
    waiting = world.ranks[0]
    assert waiting.returncode == 0 and waiting.result is not None, world.describe()
    assert waiting.result["failures"] == [] and waiting.result["num_checks"] == 1, world.describe()


@pytest.mark.parametrize("lanes", ["raw lanes", "grpc streams"])
def test_a_receive_from_a_rank_that_ended_without_sending_fails_naming_it(lanes: str) -> None:
    """Rank 1's script ends cleanly without sending what rank 0 waits for: rank 1 leaves once it has delivered
    what it sent, and rank 0's receive fails with PeerLost naming it within seconds, not after its 120 s group
    timeout (the harness kills the ranks after 60 s); on raw lanes (a lane rank 1 never opened) and on the gRPC
    streams' inboxes (without lanes, as with TLS)."""
    env = {"PARAMPLANE_TIMEOUT": "120"}
    if lanes == "grpc streams":
        env.update(PARAMPLANE_TCP_LANE="0", PARAMPLANE_UNIX_LANE="0")
    world = run_world(2, "crash.py", args=["clean"], env=env, timeout=60)
    assert not world.timed_out, world.describe()
    assert world.ranks[1].returncode == 0, world.describe()
    waiting = world.ranks[0]
    assert waiting.returncode == 0 and waiting.result is not None, world.describe()
    assert waiting.result["failures"] == [] and waiting.result["num_checks"] == 2, world.describe()
