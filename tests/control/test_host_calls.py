"""The host calls a host agent makes (JoinHost, BarrierHost) against a real coordinator on 127.0.0.1 port 0,
and a real agent (on its Unix socket) in front of it: one call answers each of its ranks on its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from paramplane import CollectiveMismatch, CollectiveTimeout
from paramplane.agent_server import AgentThread
from paramplane.coordinator.server import CoordinatorConfig, CoordinatorServer
from paramplane.host_agent import HostAgent, Relayed
from paramplane.node.coord_client import CoordinatorClient
from paramplane.protos import coordinator_pb2 as pb


@asynccontextmanager
async def coordinator(world_size: int) -> AsyncIterator[CoordinatorServer]:
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=world_size))
    try:
        yield server
    finally:
        await server.stop(grace=0.1)


@asynccontextmanager
async def clients(address: str, n: int) -> AsyncIterator[list[CoordinatorClient]]:
    made = [CoordinatorClient(address, call_timeout_s=10.0) for _ in range(n)]
    try:
        yield made
    finally:
        for c in made:
            await c.close()


@asynccontextmanager
async def joined_through_agent(address: str, n: int) -> AsyncIterator[list[CoordinatorClient]]:
    """``n`` clients joined through one real agent (host-a, on its Unix socket) in front of ``address``."""
    agent = AgentThread(address, host_id="host-a", num_local=n, token=None)
    socket = agent.start()
    try:
        async with clients(socket, n) as cs:
            joins = [
                c.join(
                    host_id="host-a", peer_address=f"127.0.0.1:{7000 + i}", instance_id=f"i{i}", timeout_s=20
                )
                for i, c in enumerate(cs)
            ]
            await asyncio.wait_for(asyncio.gather(*joins), 30)
            yield cs
    finally:
        agent.stop()


def joiners(host: str, ranks: list[int], world_size: int = 4) -> list[pb.JoinRequest]:
    return [
        pb.JoinRequest(
            host_id=host,
            peer_address=f"127.0.0.1:{7000 + r}",
            instance_id=f"inst-{r}",
            rank_hint=r,
            world_size=world_size,
            pid=1000 + r,
        )
        for r in ranks
    ]


async def test_a_host_barrier_waits_for_every_host_and_refuses_a_bad_arrival_alone() -> None:
    async with coordinator(4) as server, clients(server.address, 2) as (a, b):
        joined = await asyncio.wait_for(
            asyncio.gather(
                a.join_host(joiners("host-a", [0, 1]), timeout_s=20),
                b.join_host(joiners("host-b", [2, 3]), timeout_s=20),
            ),
            30,
        )
        assert sorted(m.rank for r in joined for m in r.members) == [0, 1, 2, 3]
        epoch = joined[0].members[0].epoch

        def arriving(ranks: list[int]) -> pb.BarrierHostRequest:
            return pb.BarrierHostRequest(epoch=epoch, name="b", arriving=ranks, timeout_s=20)

        first = asyncio.ensure_future(a.barrier_host(arriving([0, 1])))
        await a.relay("Status", pb.StatusRequest(), timeout_s=10)
        assert not first.done(), "host a's ranks were released before host b's arrived"
        second = await asyncio.wait_for(b.barrier_host(arriving([2, 9, 3])), 30)
        assert [e.code for e in second.errors][::2] == ["", ""]
        assert second.errors[1].code and "9" in second.errors[1].details, second.errors[1]
        assert [e.code for e in (await asyncio.wait_for(first, 30)).errors] == ["", ""]


async def test_a_failed_host_join_withdraws_its_other_joiners() -> None:
    async with coordinator(4) as server, clients(server.address, 2) as (a, b):
        bad = joiners("host-a", [0, 1])
        bad[1].world_size = 5
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await asyncio.wait_for(a.join_host(bad, timeout_s=20), 30)
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # Rank 0's join went with the failed call: it joins again, and the world is these four ranks.
        joined = await asyncio.wait_for(
            asyncio.gather(
                a.join_host(joiners("host-a", [0, 1]), timeout_s=20),
                b.join_host(joiners("host-b", [2, 3]), timeout_s=20),
            ),
            30,
        )
        peers = [p.address for p in joined[0].peers]
        assert peers == [f"127.0.0.1:{7000 + r}" for r in range(4)]


async def test_ranks_passing_different_barrier_ranks_through_one_agent_get_the_mismatch() -> None:
    async with coordinator(3) as server, joined_through_agent(server.address, 3) as cs:
        await asyncio.wait_for(asyncio.gather(*(c.barrier("ok", timeout_s=20) for c in cs)), 30)
        by_rank = sorted(cs, key=lambda c: c.membership.rank if c.membership else -1)
        outcomes = await asyncio.wait_for(
            asyncio.gather(
                by_rank[0].barrier("b", ranks=[0, 1], timeout_s=20),
                by_rank[1].barrier("b", ranks=[0, 1, 2], timeout_s=20),
                return_exceptions=True,
            ),
            30,
        )
        assert all(isinstance(o, CollectiveMismatch) for o in outcomes), outcomes


async def test_waiting_gets_through_one_agent_each_get_the_value_or_the_timeout() -> None:
    async with coordinator(3) as server, joined_through_agent(server.address, 3) as cs:
        missing = await asyncio.wait_for(
            asyncio.gather(
                *(c.kv_get("missing", wait=True, timeout_s=0.5) for c in cs[1:]),
                return_exceptions=True,
            ),
            30,
        )
        assert all(isinstance(m, CollectiveTimeout) for m in missing), missing
        waiting = [asyncio.ensure_future(c.kv_get("uid", wait=True, timeout_s=20)) for c in cs[1:]]
        await cs[0].kv_set("uid", b"unique id")
        assert await asyncio.wait_for(asyncio.gather(*waiting), 30) == [b"unique id"] * 2


async def answered(client: CoordinatorClient) -> dict[str, int]:
    """The calls the coordinator answered so far, by method."""
    status = await client.relay("Status", pb.StatusRequest(), timeout_s=10)
    assert isinstance(status, pb.StatusResponse)
    return dict(status.num_calls)


def kv_calls(calls: dict[str, int], kind: str) -> int:
    """The sets or waiting gets the coordinator answered, as unary calls or on a host stream."""
    return calls.get(f"KV{kind.title()}", 0) + calls.get(f"HostCalls.kv_{kind}", 0)


class _InProcess:
    """The part of a gRPC server context the agent's methods use, for calls made in process."""

    def time_remaining(self) -> float | None:
        return 10.0

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
        raise Relayed(code, details)


async def test_a_local_set_answers_the_hosts_waiting_gets_without_an_upstream_get() -> None:
    """A host's first rank sets its group's id while the others wait on it (the per-host unique id): the
    coordinator gets the set alone, every waiting rank the value; a refused set answers nobody's get."""
    async with coordinator(1) as server, clients(server.address, 2) as (rank, up):
        await rank.join(host_id="h", peer_address="127.0.0.1:7000", instance_id="i0", timeout_s=20)
        assert rank.membership is not None
        epoch = rank.membership.epoch
        agent = HostAgent(up, host_id="h", num_local=4)
        ctx: Any = _InProcess()
        setter = agent.KVSet(pb.KVSetRequest(epoch=epoch, key="uid/host", value=b"id"), ctx)
        gets = [
            agent.KVGet(pb.KVGetRequest(epoch=epoch, key="uid/host", wait=True, timeout_s=20), ctx)
            for _ in range(3)
        ]
        _, *answers = await asyncio.wait_for(asyncio.gather(setter, *gets), 30)
        assert [(a.found, a.value) for a in answers] == [(True, b"id")] * 3
        calls = await answered(up)
        assert (kv_calls(calls, "set"), kv_calls(calls, "get")) == (1, 0), calls

        stale = epoch + 7  # the coordinator refuses this epoch: the waiting gets get its own answer
        refused = agent.KVSet(pb.KVSetRequest(epoch=stale, key="k", value=b"v"), ctx)
        get = agent.KVGet(pb.KVGetRequest(epoch=stale, key="k", wait=True, timeout_s=20), ctx)
        outcomes = await asyncio.wait_for(asyncio.gather(refused, get, return_exceptions=True), 30)
        assert all(isinstance(o, Relayed) for o in outcomes), outcomes
        assert kv_calls(await answered(up), "get") == 1
