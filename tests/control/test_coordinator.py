"""The coordinator over gRPC: a real server on 127.0.0.1 port 0, clients as asyncio tasks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

import pytest

from paramplane import CollectiveMismatch, CollectiveTimeout, PeerLost, RendezvousError, WorldAborted
from paramplane.coordinator.server import CoordinatorConfig, CoordinatorServer
from paramplane.node.coord_client import CoordinatorClient, Membership, WatchEventInfo

T = TypeVar("T")


@asynccontextmanager
async def coordinator(world_size: int, **kw: float) -> AsyncIterator[CoordinatorServer]:
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=world_size, **kw))
    try:
        yield server
    finally:
        await server.stop(grace=0.1)


@asynccontextmanager
async def clients(server: CoordinatorServer, n: int) -> AsyncIterator[list[CoordinatorClient]]:
    made = [CoordinatorClient(server.address, call_timeout_s=5.0) for _ in range(n)]
    try:
        yield made
    finally:
        for c in made:
            await c.close()


def join(c: CoordinatorClient, i: int, host: str, timeout_s: float = 10.0) -> Awaitable[Membership]:
    return c.join(
        host_id=host, peer_address=f"127.0.0.1:{7000 + i}", instance_id=f"inst-{i}", timeout_s=timeout_s
    )


async def join_all(cs: list[CoordinatorClient], hosts: list[str]) -> list[Membership]:
    return list(await asyncio.gather(*(join(c, i, h) for i, (c, h) in enumerate(zip(cs, hosts)))))


async def within(seconds: float, aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, seconds)


@pytest.mark.parametrize("n", [1, 2, 4])
async def test_rendezvous_groups_ranks_by_host_with_one_peer_table(n: int) -> None:
    hosts = ["host-b" if i % 2 else "host-a" for i in range(n)]  # interleaved host ids
    async with coordinator(n) as server, clients(server, n) as cs:
        ms = await within(10, join_all(cs, hosts))
    assert sorted(m.rank for m in ms) == list(range(n))
    table = ms[0].peers
    assert all(m.peers == table and m.world_size == n and m.epoch == 1 for m in ms)
    assert len({m.job_id for m in ms}) == 1 and ms[0].job_id
    host_order = [p.host_id for p in table]
    assert host_order == sorted(host_order, key=host_order.index), "a host's ranks must be consecutive"
    assert ms[0].num_nodes == len(set(hosts))
    for i, m in enumerate(ms):
        me = table[m.rank]
        assert (me.address, me.host_id) == (f"127.0.0.1:{7000 + i}", hosts[i])
        assert (me.node_rank, me.local_rank) == (m.node_rank, m.local_rank)
        assert m.local_world_size == hosts.count(hosts[i])
        assert [p.local_rank for p in table if p.host_id == hosts[i]] == list(range(m.local_world_size))
        assert m.heartbeat_interval_s == 1.0 and m.heartbeat_timeout_s == 10.0


async def test_join_timeout_reports_how_many_joined() -> None:
    async with coordinator(3, join_timeout_s=0.5) as server, clients(server, 2) as cs:
        start = time.monotonic()
        results = await within(
            90, asyncio.gather(*(join(c, i, "h", 60.0) for i, c in enumerate(cs)), return_exceptions=True)
        )
        # The server's 0.5 s join timeout, with slack for busy cores; not the clients' own 60 s.
        assert time.monotonic() - start < 15.0
        for r in results:
            assert isinstance(r, RendezvousError)
            assert str(r).startswith("2/3 joined after 0.5 s; waiting for 1 more")


async def test_duplicate_and_extra_joiners_get_clear_errors() -> None:
    async with coordinator(2) as server, clients(server, 4) as cs:
        # Two joins with one instance id: whichever arrives second is refused at once.
        tasks = [asyncio.create_task(join(c, 0, "h")) for c in cs[:2]]
        done, pending = await within(5, asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED))
        [refused] = done
        with pytest.raises(RendezvousError, match="instance inst-0 already joined"):
            refused.result()
        [waiting] = pending
        await within(5, join(cs[2], 2, "h"))  # the world forms with a second instance
        assert (await within(5, waiting)).world_size == 2
        with pytest.raises(RendezvousError, match=r"world is full \(2 ranks\)"):
            await within(5, join(cs[3], 3, "h"))


async def test_kv_store_under_eight_concurrent_clients() -> None:
    n = 8
    async with coordinator(n) as server, clients(server, n) as cs:
        ms = await within(10, join_all(cs, ["h"] * n))
        by_rank = {m.rank: c for m, c in zip(ms, cs)}

        async def worker(rank: int, c: CoordinatorClient) -> tuple[bool, bytes | None, bytes | None]:
            for _ in range(10):
                await c.kv_add("counter", rank + 1)
            won = await c.kv_compare_set("leader", None, str(rank).encode())
            got = await c.kv_get("unique_id", wait=True, timeout_s=5.0) if rank else None
            return won[0], won[1], got

        async def setter() -> None:
            await by_rank[0].kv_set("unique_id", b"\x00\x01nccl-id")

        results, _ = await within(
            10, asyncio.gather(asyncio.gather(*(worker(r, by_rank[r]) for r in range(n))), setter())
        )
        assert await by_rank[3].kv_get("counter") == str(10 * sum(range(1, n + 1))).encode()
        assert sum(won for won, _, _ in results) == 1, "exactly one compare_set from absent wins"
        leader = next(r for r, (won, _, _) in enumerate(results) if won)
        assert {cur for _, cur, _ in results} == {str(leader).encode()}
        assert [got for _, _, got in results[1:]] == [b"\x00\x01nccl-id"] * (n - 1)
        assert await by_rank[0].kv_delete("leader") and await by_rank[1].kv_get("leader") is None
        with pytest.raises(CollectiveTimeout, match=r"key 'missing' was not set within 0\.3 s"):
            await within(5, by_rank[2].kv_get("missing", wait=True, timeout_s=0.3))
        with pytest.raises(ValueError, match="does not hold a decimal integer"):
            await by_rank[2].kv_add("unique_id")


async def test_barrier_completes_times_out_and_detects_disagreement() -> None:
    async with coordinator(3) as server, clients(server, 3) as cs:
        await within(10, join_all(cs, ["h"] * 3))
        await within(5, asyncio.gather(*(c.barrier("start", timeout_s=5.0) for c in cs)))
        await within(
            5, asyncio.gather(*(c.barrier("start", timeout_s=5.0) for c in cs))
        )  # the name is reusable
        by_rank = {c.membership.rank: c for c in cs if c.membership}
        start = time.monotonic()
        with pytest.raises(
            CollectiveTimeout, match=r"barrier 'lonely': 1/3 arrived after 0.3 s; missing ranks \[1, 2\]"
        ):
            await within(30, by_rank[0].barrier("lonely", timeout_s=0.3))
        assert time.monotonic() - start < 15.0  # the barrier's 0.3 s, with slack for busy cores
        results = await within(
            5,
            asyncio.gather(
                by_rank[0].barrier("x", ranks=[0, 1], timeout_s=5.0),
                by_rank[1].barrier("x", ranks=[0, 1, 2], timeout_s=5.0),
                return_exceptions=True,
            ),
        )
        assert all(isinstance(r, CollectiveMismatch) for r in results), results
        assert "[0, 1]" in str(results[0]) and "[0, 1, 2]" in str(results[0])


async def test_a_barrier_waiting_for_a_rank_that_left_fails_at_once_naming_it() -> None:
    async with coordinator(2) as server, clients(server, 2) as cs:
        await within(10, join_all(cs, ["h"] * 2))
        by_rank = {c.membership.rank: c for c in cs if c.membership}
        waiting = asyncio.ensure_future(by_rank[0].barrier("end", timeout_s=60.0))
        await within(5, by_rank[1].leave())
        with pytest.raises(PeerLost, match=r"barrier 'end': rank 1 left the world without arriving") as err:
            await within(5, waiting)
        assert err.value.rank == 1


async def next_event(events: AsyncIterator[WatchEventInfo], seconds: float = 5.0) -> WatchEventInfo:
    return await within(seconds, events.__anext__())


async def test_silent_rank_is_reported_dead_on_watch_streams() -> None:
    async with (
        coordinator(2, heartbeat_interval_s=0.1, heartbeat_timeout_s=1.0) as server,
        clients(server, 2) as cs,
    ):
        ms = await within(10, join_all(cs, ["h"] * 2))
        formed = time.monotonic()
        alive, silent = (cs[0], ms[1].rank) if ms[0].rank == 0 else (cs[1], ms[0].rank)
        events = alive.watch()
        assert (await next_event(events)).kind == "membership"

        async def beat() -> None:
            while True:
                await alive.heartbeat({"world": (1, 1)})
                await asyncio.sleep(0.1)  # the heartbeat period, not synchronisation

        beating = asyncio.create_task(beat())
        try:
            event = await next_event(events, 30.0)
        finally:
            beating.cancel()
        assert time.monotonic() - formed < 1.0 + 14.0  # the heartbeat timeout, with slack for a busy machine
        assert (event.kind, event.rank) == ("abort", silent)
        assert event.reason.startswith(f"rank {silent} missed heartbeats for 1.")
        # A heartbeat answers the abort the watchers got, rank and all.
        assert await alive.heartbeat({}) == event
        with pytest.raises(WorldAborted) as err:
            await alive.kv_get("k")
        assert err.value.rank == silent
        await events.aclose()


async def test_abort_and_leave_reach_every_watcher() -> None:
    async with coordinator(3) as server, clients(server, 3) as cs:
        ms = await within(10, join_all(cs, ["h"] * 3))
        streams = [c.watch() for c in cs]
        for s in streams:
            assert (await next_event(s)).kind == "membership"
        await cs[2].leave()
        for s in streams[:2]:
            assert (await next_event(s)).kind == "left"
        # A barrier of the ranks still here (one naming the departed rank would fail on arrival instead).
        staying = [ms[0].rank, ms[1].rank]
        waiting = asyncio.create_task(cs[0].barrier("never", ranks=staying, timeout_s=30.0))
        await cs[1].abort("loss is NaN")
        for s in streams[:2]:
            event = await next_event(s)
            assert (event.kind, event.rank, event.reason) == (
                "abort",
                ms[1].rank,
                f"rank {ms[1].rank} aborted: loss is NaN",
            )
        with pytest.raises(WorldAborted, match="loss is NaN"):
            await within(5, waiting)
        await cs[2].leave()  # leaving an aborted world is fine
        for s in streams:
            await s.aclose()


async def test_stop_tells_watchers_and_fails_waiting_joiners() -> None:
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=1))
    try:
        async with clients(server, 1) as cs:
            await within(5, join(cs[0], 0, "h"))
            events = cs[0].watch()
            assert (await next_event(events)).kind == "membership"
            await within(5, server.stop(grace=1.0))
            assert (await next_event(events)).kind == "shutdown"
            await events.aclose()
    finally:
        await server.stop(grace=0.1)


async def test_a_silent_rank_is_named_while_blocking_calls_keep_waking_the_coordinator() -> None:
    # A waiting call due before the ticker's next wake-up wakes it to move that wake-up; those wake-ups (here
    # every few milliseconds, the check's period is 0.25 s) must not postpone the periodic liveness check.
    async with (
        coordinator(2, heartbeat_interval_s=1.0, heartbeat_timeout_s=2.0) as server,
        clients(server, 2) as cs,
    ):
        ms = await within(10, join_all(cs, ["h"] * 2))
        formed = time.monotonic()
        alive, silent = (cs[0], ms[1].rank) if ms[0].rank == 0 else (cs[1], ms[0].rank)
        await alive.kv_set("k", b"v")

        async def busy() -> None:
            last_beat = 0.0
            while True:
                await alive.kv_get("k", wait=True, timeout_s=0.2)  # due before the next check: wakes it
                if time.monotonic() - last_beat >= 0.5:  # within the heartbeat period, not synchronisation
                    await alive.heartbeat({"world": (1, 1)})
                    last_beat = time.monotonic()

        working = asyncio.create_task(busy())
        try:
            with pytest.raises(WorldAborted) as err:
                await within(30, working)
        finally:
            working.cancel()
        assert time.monotonic() - formed < 2.0 + 14.0  # the heartbeat timeout, with slack for a busy machine
        assert f"rank {silent} missed heartbeats for 2." in str(err.value)


async def test_a_wait_shorter_than_the_check_period_times_out_at_its_own_deadline() -> None:
    # The periodic check runs every interval / 4 (5 s here); a waiter due sooner must wake the ticker itself.
    async with (
        coordinator(1, heartbeat_interval_s=20.0, heartbeat_timeout_s=60.0) as server,
        clients(server, 1) as cs,
    ):
        await within(10, join_all(cs, ["h"]))
        started = time.monotonic()
        for _ in range(3):
            with pytest.raises(CollectiveTimeout):
                await within(20, cs[0].kv_get("never set", wait=True, timeout_s=0.3))
        assert time.monotonic() - started < 4.0  # 0.9 s of timeouts, with slack; one missed wake-up is 5 s
