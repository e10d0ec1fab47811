"""The coordinator's decisions, driven by a fake clock (no network, no event loop)."""

from __future__ import annotations

import re

import pytest

from paramplane.coordinator.model import (
    Assignment,
    ErrorKind,
    EventKind,
    Joiner,
    StateError,
    group_by_host,
)
from paramplane.coordinator.state import MAX_KEY_BYTES, MAX_VALUE_BYTES, CoordinatorState


def joiner(i: int, host: str, hint: int = -1, world_size: int = 0) -> Joiner:
    return Joiner(f"inst-{i}", host, f"10.0.0.{i}:7000", hint, world_size, 1000 + i)


def state(n: int, **kw: float) -> CoordinatorState:
    return CoordinatorState(n, new_job_id=lambda: "job-1", **kw)


def form(s: CoordinatorState, hosts: list[str], now: float = 0.0) -> dict[int, Assignment]:
    """Join one joiner per entry of ``hosts`` (waiter ids 0..n-1); answers waiter -> assignment."""
    for i, host in enumerate(hosts):
        s.join(joiner(i, host), waiter=i, now=now)
    effects = s.take_effects()
    out = {r.waiter: r.value for r in effects.resolved}
    assert all(isinstance(a, Assignment) for a in out.values())
    return out  # type: ignore[return-value]


def errors(s: CoordinatorState) -> dict[int, StateError]:
    return {r.waiter: r.error for r in s.take_effects().resolved if r.error is not None}


def test_ranks_are_grouped_by_host_in_first_arrival_order() -> None:
    s = state(4)
    got = form(s, ["b", "a", "b", "a"])  # interleaved arrivals from two hosts
    ranks = {w: a.rank for w, a in got.items()}
    assert ranks == {0: 0, 2: 1, 1: 2, 3: 3}  # host b arrived first: its ranks come first
    assert [(got[w].node_rank, got[w].local_rank, got[w].local_world_size) for w in (0, 2, 1, 3)] == [
        (0, 0, 2),
        (0, 1, 2),
        (1, 0, 2),
        (1, 1, 2),
    ]
    peers = got[0].peers
    assert all(
        a.peers == peers and a.num_nodes == 2 and a.epoch == 1 and a.job_id == "job-1" for a in got.values()
    )
    assert [(p.rank, p.host_id, p.address) for p in peers] == [
        (0, "b", "10.0.0.0:7000"),
        (1, "b", "10.0.0.2:7000"),
        (2, "a", "10.0.0.1:7000"),
        (3, "a", "10.0.0.3:7000"),
    ]


def test_consistent_hints_are_the_ranks_and_inconsistent_ones_only_order_a_host() -> None:
    hinted = [joiner(0, "b", 3), joiner(1, "a", 0), joiner(2, "b", 2), joiner(3, "a", 1)]
    assert [[j.rank_hint for j in host] for host in group_by_host(hinted)] == [[0, 1], [2, 3]]
    # Hints that would split host a: hosts keep first-arrival order, hints order ranks within a host.
    split = [joiner(0, "a", 0), joiner(1, "b", 1), joiner(2, "a", 2), joiner(3, "b", 3)]
    assert [[j.instance_id for j in h] for h in group_by_host(split)] == [
        ["inst-0", "inst-2"],
        ["inst-1", "inst-3"],
    ]
    mixed = [joiner(0, "a"), joiner(1, "a", 1), joiner(2, "a", 0)]
    assert [j.instance_id for j in group_by_host(mixed)[0]] == ["inst-2", "inst-1", "inst-0"]


def test_join_timeout_fails_every_waiter_with_k_of_n_and_allows_a_new_attempt() -> None:
    s = state(3, join_timeout_s=30.0)
    s.join(joiner(0, "a"), waiter=0, now=100.0)
    s.join(joiner(1, "a"), waiter=1, now=110.0)
    assert s.next_deadline() == 130.0
    s.tick(129.9)
    assert not s.take_effects().resolved
    s.tick(130.0)
    failed = errors(s)
    assert set(failed) == {0, 1}
    assert failed[0].kind is ErrorKind.DEADLINE_EXCEEDED
    assert str(failed[0]).startswith("2/3 joined after 30.0 s; waiting for 1 more")
    assert "check that all 3 ranks were started" in str(failed[0])
    assert s.next_deadline() is None
    got = form(s, ["a", "a", "a"], now=200.0)  # the same instances may try again
    assert sorted(a.rank for a in got.values()) == [0, 1, 2]


def test_duplicate_extra_and_mismatched_joiners_are_refused() -> None:
    s = state(2)
    s.join(joiner(0, "a", hint=1), waiter=0, now=0.0)
    with pytest.raises(StateError, match="already joined") as dup:
        s.join(joiner(0, "a"), waiter=1, now=0.0)
    assert dup.value.kind is ErrorKind.ALREADY_EXISTS
    with pytest.raises(StateError, match="rank hint 1 is already taken") as hint:
        s.join(joiner(1, "a", hint=1), waiter=1, now=0.0)
    assert hint.value.kind is ErrorKind.ALREADY_EXISTS
    with pytest.raises(
        StateError, match="expects world size 3 but the coordinator was started with --world-size 2"
    ):
        s.join(joiner(1, "a", world_size=3), waiter=1, now=0.0)
    with pytest.raises(StateError, match=r"outside 0\.\.1") as bad:
        s.join(joiner(1, "a", hint=2), waiter=1, now=0.0)
    assert bad.value.kind is ErrorKind.INVALID_ARGUMENT
    s.join(joiner(1, "a", world_size=2), waiter=1, now=0.0)
    assert len(s.take_effects().resolved) == 2
    with pytest.raises(StateError, match=r"world is full \(2 ranks\)") as full:
        s.join(joiner(2, "a"), waiter=2, now=1.0)
    assert full.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    with pytest.raises(StateError, match="already joined") as member:
        s.join(joiner(0, "a"), waiter=2, now=1.0)
    assert member.value.kind is ErrorKind.ALREADY_EXISTS


def test_a_cancelled_joiner_is_withdrawn() -> None:
    s = state(2)
    s.join(joiner(0, "a", hint=0), waiter=0, now=0.0)
    s.cancel(0)
    s.join(joiner(1, "a", hint=0), waiter=1, now=1.0)  # the hint is free again
    assert s.world is None
    assert s.next_deadline() == 1.0 + 300.0  # counted from the first joiner still waiting


def test_kv_store_add_compare_set_wait_and_limits() -> None:
    s = state(1, heartbeat_timeout_s=1e9)
    form(s, ["a"])
    assert s.kv_add(1, "n", 5) == 5 and s.kv_add(1, "n", -2) == 3
    assert s.kv_get(1, "n") == b"3"
    assert s.kv_compare_set(1, "lock", None, b"r0") == (True, b"r0")
    assert s.kv_compare_set(1, "lock", None, b"r1") == (False, b"r0")
    assert s.kv_compare_set(1, "lock", b"r0", b"r2") == (True, b"r2")
    assert s.kv_delete(1, "lock") and not s.kv_delete(1, "lock")
    s.kv_wait(1, "id", timeout_s=5.0, waiter=7, now=10.0)
    assert not s.take_effects().resolved
    s.kv_set(1, "id", b"\x00nccl")
    assert [(r.waiter, r.value) for r in s.take_effects().resolved] == [(7, b"\x00nccl")]
    s.kv_wait(1, "never", timeout_s=5.0, waiter=8, now=10.0)
    s.tick(15.0)
    assert "key 'never' was not set within 5.0 s" in str(errors(s)[8])
    with pytest.raises(StateError, match="does not hold a decimal integer"):
        s.kv_add(1, "id", 1)
    with pytest.raises(StateError, match="overflows int64"):
        s.kv_add(1, "n", 2**63)
    with pytest.raises(StateError, match=re.escape(f"1..{MAX_KEY_BYTES} bytes")):
        s.kv_set(1, "k" * (MAX_KEY_BYTES + 1), b"")
    with pytest.raises(StateError, match="the limit is") as big:
        s.kv_set(1, "big", bytes(MAX_VALUE_BYTES + 1))
    assert big.value.kind is ErrorKind.INVALID_ARGUMENT
    with pytest.raises(StateError, match="epoch 2 is not the current epoch 1") as stale:
        s.kv_get(2, "n")
    assert stale.value.kind is ErrorKind.FAILED_PRECONDITION


def test_barrier_completes_and_its_name_can_be_reused() -> None:
    s = state(3)
    form(s, ["a", "a", "a"])
    for round_ in range(2):
        s.barrier(1, "step", 0, [], 5.0, waiter=10 * round_, now=0.0)
        s.barrier(1, "step", 2, [], 5.0, waiter=10 * round_ + 2, now=0.0)
        assert not s.take_effects().resolved
        s.barrier(1, "step", 1, [], 5.0, waiter=10 * round_ + 1, now=0.0)
        resolved = s.take_effects().resolved
        assert sorted(r.waiter for r in resolved) == [10 * round_ + i for i in range(3)]
        assert all(r.error is None for r in resolved)
    s.barrier(1, "pair", 2, [2, 0], 5.0, waiter=30, now=0.0)
    s.barrier(1, "pair", 0, [0, 2], 5.0, waiter=31, now=0.0)
    assert {r.waiter for r in s.take_effects().resolved} == {30, 31}
    assert s.next_deadline() is None


def test_barrier_disagreement_fails_the_arrival_and_the_waiters() -> None:
    s = state(3)
    form(s, ["a", "a", "a"])
    s.barrier(1, "x", 0, [0, 1], 5.0, waiter=1, now=0.0)
    with pytest.raises(StateError) as err:
        s.barrier(1, "x", 1, [0, 1, 2], 5.0, waiter=2, now=0.0)
    assert err.value.mismatch and err.value.kind is ErrorKind.FAILED_PRECONDITION
    assert "rank 1 passed ranks [0, 1, 2] but rank 0 arrived first with ranks [0, 1]" in str(err.value)
    assert errors(s)[1] is err.value


def test_barrier_timeout_names_the_missing_ranks() -> None:
    s = state(4)
    form(s, ["a"] * 4)
    s.barrier(1, "x", 0, [], 2.0, waiter=1, now=0.0)
    s.barrier(1, "x", 3, [], 2.0, waiter=2, now=1.0)
    s.tick(2.0)
    assert str(errors(s)[1]) == "barrier 'x': 2/4 arrived after 2.0 s; missing ranks [1, 2]"
    s.tick(3.0)
    assert str(errors(s)[2]) == "barrier 'x': 1/4 arrived after 2.0 s; missing ranks [0, 1, 2]"


def test_barrier_fails_at_once_when_a_participant_leaves_without_arriving() -> None:
    s = state(3)
    form(s, ["a"] * 3)
    s.barrier(1, "x", 0, [], 60.0, waiter=1, now=0.0)
    s.barrier(1, "pair", 0, [0, 2], 60.0, waiter=2, now=0.0)
    s.take_effects()
    s.leave(1, 1)  # waited for at "x", not a participant of "pair"
    failed = errors(s)
    assert list(failed) == [1]
    assert failed[1].left == 1 and failed[1].kind is ErrorKind.FAILED_PRECONDITION
    assert str(failed[1]) == "barrier 'x': rank 1 left the world without arriving (1/3 arrived)"
    s.barrier(1, "pair", 2, [0, 2], 60.0, waiter=3, now=1.0)
    assert sorted(r.waiter for r in s.take_effects().resolved if r.error is None) == [2, 3]
    s.barrier(1, "y", 2, [], 60.0, waiter=4, now=2.0)  # a barrier that starts after the leave
    assert errors(s)[4].left == 1
    # A watch stream opened after the leave is told of it (its receives from rank 1 fail, node/runtime.py).
    assert [(e.kind, e.rank) for e in s.snapshot_events(1, 0)] == [
        (EventKind.MEMBERSHIP, 0),
        (EventKind.LEFT, 1),
    ]


def test_a_hosts_arrivals_wait_under_one_waiter_and_a_bad_rank_is_refused_alone() -> None:
    s = state(6)
    form(s, ["a", "a", "a", "b", "b", "b"])
    # Host a: rank 2 twice and rank 7 (not in the world) are refused alone; 0 and 2 arrive under waiter 10.
    refused = s.barrier_many(1, "x", [0, 2, 2, 7], [], 5.0, waiter=10, now=0.0)
    assert [e is None for e in refused] == [True, True, False, False]
    assert "rank 2 is already waiting" in str(refused[2]) and "rank 7" in str(refused[3])
    assert s.barrier_many(1, "x", [1, 3, 4], [], 5.0, waiter=11, now=0.0) == [None] * 3
    assert not s.take_effects().resolved
    s.barrier(1, "x", 5, [], 5.0, waiter=12, now=0.0)
    resolved = s.take_effects().resolved
    assert sorted(r.waiter for r in resolved) == [10, 11, 12]  # one resolution per waiter, not per rank
    assert all(r.error is None for r in resolved)
    # A subset barrier: a rank outside it is refused, the others arrive.
    refused = s.barrier_many(1, "pair", [0, 1], [0, 3], 5.0, waiter=20, now=0.0)
    assert refused[0] is None and refused[1] is not None and "not among [0, 3]" in str(refused[1])
    # Every arrival refused: nothing is registered (no barrier, no deadline).
    assert all(e is not None for e in s.barrier_many(1, "none", [9, 9], [], 5.0, waiter=21, now=0.0))
    assert s.next_deadline() == 5.0  # only "pair"'s waiter


def test_a_withdrawn_host_waiter_takes_all_its_ranks_and_a_timeout_names_the_missing_ones() -> None:
    s = state(4)
    form(s, ["a", "a", "b", "b"])
    s.barrier_many(1, "x", [0, 1], [], 5.0, waiter=10, now=0.0)
    s.cancel(10)  # the host's call went away: both of its ranks are withdrawn
    s.barrier_many(1, "x", [2, 3], [], 5.0, waiter=11, now=0.0)
    assert not s.take_effects().resolved
    s.tick(5.0)
    assert str(errors(s)[11]) == "barrier 'x': 2/4 arrived after 5.0 s; missing ranks [0, 1]"
    with pytest.raises(StateError, match="rank 0 passed ranks \\[0, 1\\] but rank 2 arrived first"):
        s.barrier_many(1, "y", [2], [0, 1, 2, 3], 5.0, waiter=12, now=6.0)
        s.barrier_many(1, "y", [0, 1], [0, 1], 5.0, waiter=13, now=6.0)
    assert errors(s)[12].mismatch


def test_silent_rank_is_declared_dead_at_the_heartbeat_timeout() -> None:
    s = state(3, heartbeat_timeout_s=10.0)
    form(s, ["a", "a", "b"], now=100.0)
    s.barrier(1, "x", 0, [], 60.0, waiter=9, now=100.0)
    for t in (101.0, 105.0, 109.0):
        for rank in (0, 2):
            assert s.heartbeat(1, rank, {}, now=t) is None
        s.tick(t)
    s.tick(110.0)
    assert not s.take_effects().events
    s.tick(110.5)  # rank 1 never sent one: silent since the world formed at 100
    effects = s.take_effects()
    [event] = effects.events
    assert event.kind is EventKind.ABORT and event.rank == 1
    assert event.reason.startswith(
        "rank 1 missed heartbeats for 10.5 s (last seen never since the world formed"
    )
    assert [(r.waiter, r.error and r.error.kind) for r in effects.resolved] == [(9, ErrorKind.ABORTED)]
    # A heartbeat answers the same abort the watchers got: a lost rank, named (not a bare "aborted").
    assert s.heartbeat(1, 0, {}, now=111.0) == event and event.lost
    with pytest.raises(StateError) as after:
        s.kv_get(1, "k")
    assert after.value.kind is ErrorKind.ABORTED and after.value.rank == 1
    s.tick(200.0)
    assert not s.take_effects().events  # an aborted world stays aborted, once


def test_a_rank_that_left_is_never_dead() -> None:
    s = state(2, heartbeat_timeout_s=10.0)
    form(s, ["a", "a"], now=0.0)
    s.heartbeat(1, 0, {}, now=5.0)
    s.leave(1, 0)
    [left] = s.take_effects().events
    assert left.kind is EventKind.LEFT and left.rank == 0
    for t in (8.0, 16.0, 24.0):
        s.heartbeat(1, 1, {}, now=t)
        s.tick(t)
    assert not s.take_effects().events
    s.tick(40.0)
    [dead] = s.take_effects().events
    assert dead.rank == 1 and "last seen 24.0 s after the world formed" in dead.reason


def test_progress_watchdog_names_the_lagging_rank() -> None:
    s = state(2, heartbeat_timeout_s=1e9, progress_timeout_s=300.0)
    form(s, ["a", "b"], now=0.0)
    s.heartbeat(1, 0, {"world": (5, 4)}, now=0.0)
    s.heartbeat(1, 1, {"world": (4, 4)}, now=0.0)
    for t in (100.0, 200.0, 300.0):
        s.heartbeat(1, 0, {"world": (5, 4)}, now=t)  # rank 0 waits in op 5 for rank 1
        s.heartbeat(1, 1, {"world": (4, 4)}, now=t)  # rank 1 never issues op 5
        s.tick(t)
    assert not s.take_effects().events
    s.tick(301.0)
    [event] = s.take_effects().events
    assert event.kind is EventKind.ABORT and event.rank == 1
    assert (
        "rank 1 made no progress on group 'world' for 301.0 s (issued 4, completed 4) while rank 0 issued 5"
        in (event.reason)
    )


def test_progress_that_keeps_moving_is_not_stuck_and_zero_turns_the_watchdog_off() -> None:
    s = state(2, heartbeat_timeout_s=1e9, progress_timeout_s=300.0)
    form(s, ["a", "a"], now=0.0)
    for step in range(1, 8):  # rank 1 is always one op behind, but moves every 200 s
        t = step * 200.0
        s.heartbeat(1, 0, {"g": (step + 1, step)}, now=t)
        s.heartbeat(1, 1, {"g": (step, step - 1)}, now=t)
        s.tick(t + 250.0)
    assert not s.take_effects().events
    s = state(2, heartbeat_timeout_s=1e9, progress_timeout_s=0.0)
    form(s, ["a", "a"], now=0.0)
    s.heartbeat(1, 0, {"g": (9, 9)}, now=0.0)
    s.heartbeat(1, 1, {"g": (1, 1)}, now=0.0)
    s.tick(1e6)
    assert not s.take_effects().events


def test_abort_by_a_rank_names_it_and_fails_waiters() -> None:
    s = state(2)
    form(s, ["a", "a"])
    s.kv_wait(1, "k", timeout_s=9.0, waiter=5, now=0.0)
    s.abort(1, 1, "CUDA error: out of memory")
    effects = s.take_effects()
    [event] = effects.events
    assert (event.kind, event.rank, event.reason) == (
        EventKind.ABORT,
        1,
        "rank 1 aborted: CUDA error: out of memory",
    )
    [res] = effects.resolved
    assert (
        res.waiter == 5
        and res.error is not None
        and res.error.kind is ErrorKind.ABORTED
        and res.error.rank == 1
    )
    s.abort(1, 0, "second")
    assert not s.take_effects().events
    assert [e.kind for e in s.snapshot_events(1, 0)] == [EventKind.MEMBERSHIP, EventKind.ABORT]


def test_a_join_after_an_abort_forms_the_next_epoch() -> None:
    """Restarted ranks (launch --max-restarts, on every host) re-form the world at epoch + 1."""
    s = state(2)
    form(s, ["a", "b"])
    s.kv_set(1, "nccl/world", b"old")
    s.abort(1, 1, "rank 1 died")
    s.take_effects()
    s.join(joiner(10, "a"), waiter=10, now=5.0)
    assert s.epoch == 2 and s.world is None
    with pytest.raises(StateError) as stale:
        s.kv_get(1, "nccl/world")  # a survivor of the old world is told to join again
    assert "join again" in str(stale.value)
    s.join(joiner(11, "b"), waiter=11, now=5.5)
    formed = s.take_effects().formed
    assert [a.epoch for a in formed] == [2, 2]
    assert s.kv_get(2, "nccl/world") is None  # the old epoch's keys are gone


def test_shutdown_fails_every_waiter() -> None:
    s = state(2)
    s.join(joiner(0, "a"), waiter=0, now=0.0)
    s.shutdown()
    effects = s.take_effects()
    assert [r.error and r.error.kind for r in effects.resolved] == [ErrorKind.UNAVAILABLE]
    assert [e.kind for e in effects.events] == [EventKind.SHUTDOWN]


def test_the_kv_store_is_bounded_and_deleting_frees_room(monkeypatch: pytest.MonkeyPatch) -> None:
    import paramplane.coordinator.state as st

    monkeypatch.setattr(st, "MAX_KV_KEYS", 3)
    monkeypatch.setattr(st, "MAX_KV_BYTES", 40)
    s = state(2)
    form(s, ["a", "a"])
    for k in ("k1", "k2", "k3"):
        s.kv_set(1, k, b"x")
    with pytest.raises(StateError) as many:
        s.kv_set(1, "k4", b"x")
    assert many.value.kind is ErrorKind.RESOURCE_EXHAUSTED and "3 keys" in str(many.value)
    s.kv_set(1, "k1", b"y" * 10)  # overwriting an existing key needs no new key
    with pytest.raises(StateError) as big:
        s.kv_set(1, "k2", b"z" * 40)
    assert big.value.kind is ErrorKind.RESOURCE_EXHAUSTED and "past 40 bytes" in str(big.value)
    assert s.kv_delete(1, "k3")
    s.kv_set(1, "k4", b"x")  # room again
    assert s.kv_get(1, "k2") == b"x"  # nothing was modified by the refused calls


def test_a_group_idle_for_long_is_not_stuck_when_one_rank_issues_the_next_op_first() -> None:
    s = state(2, heartbeat_timeout_s=1e9, progress_timeout_s=300.0)
    form(s, ["a", "b"], now=0.0)
    for rank in (0, 1):
        s.heartbeat(1, rank, {"world": (4, 4)}, now=0.0)  # both done with op 4; the group then idles
    s.heartbeat(1, 0, {"world": (5, 4)}, now=1000.0)  # rank 0 issues op 5 first, rank 1 is still computing
    s.heartbeat(1, 1, {"world": (4, 4)}, now=1000.0)
    s.tick(1001.0)
    assert not s.take_effects().events
    s.tick(1299.0)
    assert not s.take_effects().events
    s.tick(1301.0)  # rank 1 never issues op 5: stuck, counted from when rank 0 issued it
    [event] = s.take_effects().events
    assert event.kind is EventKind.ABORT and event.rank == 1
    assert "no progress on group 'world' for 301.0 s" in event.reason


def test_a_silent_host_agent_is_named_with_its_ranks_and_a_silent_rank_under_a_live_agent_alone() -> None:
    """Heartbeats carried by host agents: callers count agents, not ranks; an agent gone quiet is named with its
    ranks, while a rank its (live) agent stopped carrying is named as itself."""
    s = state(4, heartbeat_timeout_s=10.0)
    form(s, ["a", "a", "b", "b"], now=100.0)
    for t in (101.0, 106.0):
        for rank in range(4):
            s.heartbeat(1, rank, {}, now=t, agent="agent-a" if rank < 2 else "agent-b")
    status = s.status(106.0)
    assert status["num_heartbeat_callers"] == 2
    assert [r["agent"] for r in status["ranks"]] == ["agent-a", "agent-a", "agent-b", "agent-b"]
    for t in (110.0, 114.0, 116.0):  # agent-b goes quiet after 106
        for rank in (0, 1):
            s.heartbeat(1, rank, {}, now=t, agent="agent-a")
        s.tick(t)
    assert s.status(116.4)["num_heartbeat_callers"] == 1  # agent-b silent 10.4 s
    s.tick(116.5)
    [event] = s.take_effects().events
    assert event.kind is EventKind.ABORT and event.lost and event.rank == 2
    assert event.reason.startswith(
        "the host agent agent-b (ranks [2, 3], host b) missed heartbeats for 10.5 s"
    )

    s = state(2, heartbeat_timeout_s=10.0)
    form(s, ["a", "a"], now=100.0)
    for t in (101.0, 106.0, 110.0):
        s.heartbeat(1, 0, {}, now=t, agent="agent-a")  # rank 1 never beats (hangs); its agent is alive
        s.tick(t)
    s.tick(110.5)
    [event] = s.take_effects().events
    assert event.rank == 1 and event.reason.startswith("rank 1 missed heartbeats for 10.5 s")

    # A rank that beat and then stopped: past its deadline, it is named only once its agent has called again
    # without it (before that, the beats it sent may have died with an agent that is itself lost).
    s = state(2, heartbeat_timeout_s=10.0)
    form(s, ["a", "a"], now=100.0)
    s.heartbeat(1, 1, {}, now=101.0, agent="agent-a")
    for t in (101.0, 106.0, 110.0):
        s.heartbeat(1, 0, {}, now=t, agent="agent-a")
    s.tick(111.2)  # rank 1 silent 10.2 s; agent-a last called at 110, before rank 1's deadline (111)
    assert not s.take_effects().events
    s.heartbeat(1, 0, {}, now=111.4, agent="agent-a")
    s.tick(111.5)
    [event] = s.take_effects().events
    assert event.rank == 1 and event.reason.startswith("rank 1 missed heartbeats for 10.5 s")


def test_an_abort_reported_lost_by_a_host_agent_names_the_dead_rank_with_its_reason() -> None:
    s = state(2)
    form(s, ["a", "a"])
    s.abort(1, 1, "rank 1 (pid 7, host a) was killed by SIGKILL", lost=True)
    [event] = s.take_effects().events
    assert (event.rank, event.lost, event.reason) == (1, True, "rank 1 (pid 7, host a) was killed by SIGKILL")


def test_the_laggard_is_named_even_when_a_waiting_rank_reported_a_beat_earlier() -> None:
    """Ranks 0 and 2 issue op 2 and wait; rank 1 stalls after op 1, and its report of finishing op 1 arrives a
    beat after theirs. The first tick past the timeout names rank 1 (issued 1), not rank 0, whose own wait
    crossed the timeout first."""
    s = state(3, heartbeat_timeout_s=1e9, progress_timeout_s=2.0)
    form(s, ["a", "a", "a"], now=0.0)
    for rank in (0, 2):
        s.heartbeat(1, rank, {"world": (2, 1)}, now=10.0)
    s.heartbeat(1, 1, {"world": (1, 1)}, now=10.1)
    s.tick(11.9)
    assert not s.take_effects().events
    s.tick(12.04)  # ranks 0 and 2 have waited 2.04 s, rank 1 has been idle 1.94 s since its report
    [event] = s.take_effects().events
    assert event.kind is EventKind.ABORT and event.rank == 1 and event.lost
    assert "rank 1 made no progress on group 'world' for 2.0 s (issued 1, completed 1)" in event.reason
