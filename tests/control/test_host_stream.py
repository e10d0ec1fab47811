"""Host agents' barriers, sets and waiting gets on their HostCalls stream (coordinator/host_stream.py,
client/agent_stream.py): real coordinators on 127.0.0.1 port 0, real agents, real gRPC.

Each use of a barrier name is its own call (a later use waits for its own arrivals), per-rank errors reach
exactly their ranks typed, a broken stream opens again without losing a release, ranks calling the
coordinator themselves keep their unary calls, and a coordinator without the stream gets the unary calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest

from paramplane import CollectiveTimeout, WorldAborted
from paramplane.agent_server import AgentThread
from paramplane.agent_stream import HostCallStream
from paramplane.coordinator import host_stream
from paramplane.coordinator.server import CoordinatorConfig, CoordinatorServer
from paramplane.coordinator.service import CoordinatorService
from paramplane.host_agent import HostAgent, Relayed
from paramplane.node.coord_client import CoordinatorClient
from paramplane.protos import coordinator_pb2 as pb


@asynccontextmanager
async def world(num_hosts: int, per_host: int, num_direct: int = 0) -> AsyncIterator[tuple[Any, list[Any]]]:
    """A coordinator, ``num_hosts`` real agents (Unix sockets) of ``per_host`` ranks each and ``num_direct``
    ranks calling the coordinator themselves, all joined: (status client, ranks by rank)."""
    async with served_world(num_hosts, per_host, num_direct) as (_, status, ranks):
        yield status, ranks


@asynccontextmanager
async def served_world(
    num_hosts: int, per_host: int, num_direct: int = 0, agents_out: list[AgentThread] | None = None
) -> AsyncIterator[tuple[CoordinatorServer, Any, list[Any]]]:
    """``world``, with its coordinator server first (and its agents appended to ``agents_out``)."""
    n = num_hosts * per_host + num_direct
    # No heartbeats here: a timeout longer than any test keeps the world from aborting for silence.
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=n, heartbeat_timeout_s=120))
    agents = [
        AgentThread(server.address, host_id=f"host-{h}", num_local=per_host, token=None)
        for h in range(num_hosts)
    ]
    if agents_out is not None:
        agents_out.extend(agents)
    made: list[CoordinatorClient] = []
    try:
        hosts = []  # rank -> host: host h's ranks first, by host, then the direct ranks
        for h, agent in enumerate(agents):
            socket = agent.start()
            made += [CoordinatorClient(socket, call_timeout_s=10.0) for _ in range(per_host)]
            hosts += [f"host-{h}"] * per_host
        made += [CoordinatorClient(server.address, call_timeout_s=10.0) for _ in range(num_direct)]
        hosts += ["direct"] * num_direct
        calls = [
            c.join(
                host_id=host,
                peer_address=f"127.0.0.1:{7000 + r}",
                instance_id=f"i{r}",
                rank_hint=r,
                timeout_s=20,
            )
            for r, (c, host) in enumerate(zip(made, hosts, strict=True))
        ]
        await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert [c.membership.rank if c.membership else -1 for c in made] == list(range(n))
        status = CoordinatorClient(server.address, call_timeout_s=10.0)
        made.append(status)
        yield server, status, made[:-1]
    finally:
        for c in made:
            await c.close()
        for agent in agents:
            agent.stop()
        await server.stop(grace=0.1)


async def calls(client: CoordinatorClient) -> dict[str, int]:
    return dict((await client.status()).num_calls)


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20.0) -> None:
    """Ask ``check`` until it holds (bounded): the coordinator's state is observed, not slept on."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.02)


async def test_a_reused_barrier_name_waits_for_its_own_arrivals_and_direct_ranks_keep_their_calls() -> None:
    async with world(num_hosts=2, per_host=2, num_direct=1) as (status, ranks):
        await asyncio.wait_for(asyncio.gather(*(r.barrier("b", timeout_s=20) for r in ranks)), 30)
        # Host 0's ranks and the direct rank use the name again; host 1's ranks come later.
        early = [asyncio.ensure_future(r.barrier("b", timeout_s=20)) for r in (*ranks[:2], ranks[4])]

        async def arrived() -> bool:
            c = await calls(status)
            return c.get("HostCalls.barrier") == 3 and c.get("Barrier") == 2

        await until(arrived, "host 0's and the direct rank's second arrivals")
        assert not any(t.done() for t in early), "the first use's release freed the second use"
        await asyncio.wait_for(asyncio.gather(*(r.barrier("b", timeout_s=20) for r in ranks[2:4])), 30)
        await asyncio.wait_for(asyncio.gather(*early), 30)
        c = await calls(status)
        # The agents' arrivals went on their streams (one per host and use), the direct rank's as its own calls.
        assert (c.get("HostCalls.barrier"), c.get("Barrier"), c.get("BarrierHost", 0)) == (4, 2, 0), c


async def test_a_timeout_and_an_abort_reach_the_waiting_ranks_typed_through_the_stream() -> None:
    async with world(num_hosts=2, per_host=2) as (_, ranks):
        timed = await asyncio.wait_for(
            asyncio.gather(*(r.barrier("t", timeout_s=0.5) for r in ranks[:3]), return_exceptions=True), 30
        )
        assert all(isinstance(t, CollectiveTimeout) and "missing ranks" in str(t) for t in timed), timed
        gets = [asyncio.ensure_future(r.kv_get("never", wait=True, timeout_s=20)) for r in ranks[:2]]
        waiting = [asyncio.ensure_future(r.barrier("x", timeout_s=20)) for r in ranks[:2]]
        await ranks[3].abort("rank 3 gives up")
        outcomes = await asyncio.wait_for(asyncio.gather(*gets, *waiting, return_exceptions=True), 30)
        assert all(isinstance(o, WorldAborted) and o.rank == 3 for o in outcomes), outcomes


class _InProcess:
    """The part of a gRPC server context the agent's methods use, for calls made in process."""

    def time_remaining(self) -> float | None:
        return 10.0

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> None:
        raise Relayed(code, details)


def joiners(host: str, ranks: list[int]) -> list[pb.JoinRequest]:
    return [
        pb.JoinRequest(host_id=host, peer_address=f"127.0.0.1:{7000 + r}", instance_id=f"i{r}", rank_hint=r)
        for r in ranks
    ]


async def test_a_broken_stream_opens_again_and_the_release_still_arrives() -> None:
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=4, heartbeat_timeout_s=120))
    up, other, status = (CoordinatorClient(server.address, call_timeout_s=10.0) for _ in range(3))
    agent = HostAgent(up, host_id="host-a", num_local=2)
    try:
        ctx: Any = _InProcess()
        joined = await asyncio.wait_for(
            asyncio.gather(
                *(agent.join(j, 20) for j in joiners("host-a", [0, 1])),
                other.join_host(joiners("host-b", [2, 3]), timeout_s=20),
            ),
            30,
        )
        epoch = joined[0][0].epoch
        waiting = [
            asyncio.ensure_future(
                agent.Barrier(pb.BarrierRequest(epoch=epoch, name="b", rank=r, timeout_s=20), ctx)
            )
            for r in (0, 1)
        ]

        async def count(name: str, value: int) -> bool:
            return (await calls(status)).get(name) == value

        await until(lambda: count("HostCalls.barrier", 1), "host a's arrival on its stream")
        broken = agent._host_stream._stream
        assert broken is not None
        broken.cancel()  # the agent's stream breaks while its ranks wait
        await until(lambda: count("HostCalls", 2), "the agent's stream opened again")
        arrivals = pb.BarrierHostRequest(epoch=epoch, name="b", arriving=[2, 3], timeout_s=20)
        assert [e.code for e in (await asyncio.wait_for(other.barrier_host(arrivals), 30)).errors] == ["", ""]
        assert await asyncio.wait_for(asyncio.gather(*waiting), 30) == [pb.BarrierResponse()] * 2
        assert (await calls(status)).get("HostCalls.barrier") == 1, "the arrival sent again was done twice"
    finally:
        await agent.stop()
        for c in (other, status):
            await c.close()
        await server.stop(grace=0.1)


async def test_a_release_while_no_stream_is_open_is_answered_on_the_next_stream() -> None:
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=4, heartbeat_timeout_s=120))
    a, b = (CoordinatorClient(server.address, call_timeout_s=10.0) for _ in range(2))
    try:
        joined = await asyncio.wait_for(
            asyncio.gather(
                a.join_host(joiners("host-a", [0, 1]), timeout_s=20),
                b.join_host(joiners("host-b", [2, 3]), timeout_s=20),
            ),
            30,
        )
        epoch = joined[0].members[0].epoch
        arrival = pb.HostCall(
            call_id=1, barrier=pb.BarrierHostRequest(epoch=epoch, name="b", arriving=[0, 1], timeout_s=20)
        )
        first = a.host_calls()
        await first.write(pb.HostCall(session="s"))
        assert server.lanes is not None
        # The session's acknowledgement, offering the host lane.
        assert await asyncio.wait_for(answer_of(first), 30) == pb.HostAnswer(lane_port=server.lanes.port)
        await first.write(arrival)
        await until(lambda: _has(b, "HostCalls.barrier", 1), "the arrival on the first stream")
        first.cancel()
        # Released while host a has no stream: the answer waits for the session's next stream.
        late = pb.BarrierHostRequest(epoch=epoch, name="b", arriving=[2, 3], timeout_s=20)
        await asyncio.wait_for(b.barrier_host(late), 30)
        second = a.host_calls()
        await second.write(pb.HostCall(session="s"))
        arrival.resent = True
        await second.write(arrival)
        answer = await asyncio.wait_for(answer_of(second), 30)
        while answer.call_id == 0:
            answer = await asyncio.wait_for(answer_of(second), 30)
        assert answer.call_id == 1 and [e.code for e in answer.barrier.errors] == ["", ""], answer
        # A new call whose id was used already is refused, not done again.
        arrival.resent = False
        await second.write(arrival)
        refused = await asyncio.wait_for(answer_of(second), 30)
        while refused.HasField("barrier"):  # the answer may come twice (sent again): the agent ignores that
            refused = await asyncio.wait_for(answer_of(second), 30)
        assert refused.error.code == "INVALID_ARGUMENT", refused
        second.cancel()
    finally:
        for c in (a, b):
            await c.close()
        await server.stop(grace=0.1)


async def answer_of(stream: Any) -> pb.HostAnswer:
    answer = await stream.read()
    assert isinstance(answer, pb.HostAnswer), answer
    return answer


async def _has(client: CoordinatorClient, name: str, value: int) -> bool:
    return (await calls(client)).get(name) == value


async def test_an_older_coordinator_without_the_stream_gets_the_unary_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def unimplemented(self: Any, requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(CoordinatorService, "HostCalls", unimplemented)
    async with world(num_hosts=2, per_host=2) as (status, ranks):
        await asyncio.wait_for(asyncio.gather(*(r.barrier("b", timeout_s=20) for r in ranks)), 30)
        waiting = [asyncio.ensure_future(r.kv_get("uid", wait=True, timeout_s=20)) for r in ranks[1:]]
        await ranks[0].kv_set("uid", b"id")
        assert await asyncio.wait_for(asyncio.gather(*waiting), 30) == [b"id"] * 3
        c = await calls(status)
        assert c.get("BarrierHost") == 2 and c.get("KVSet") == 1 and not c.get("HostCalls.barrier"), c


async def test_an_agent_opens_its_hosts_streams_before_answering_its_ranks_joins() -> None:
    """The first barrier after the joins does not wait behind every host opening its streams."""
    async with world(num_hosts=2, per_host=2) as (status, _):
        c = await calls(status)
        assert (c.get("HostCalls"), c.get("Watch")) == (2, 2), c


async def test_a_resent_call_whose_answer_is_no_longer_kept_is_answered_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answers kept for calls sent again are bounded in bytes (a get's value may be large): one past the bound
    is answered with an error at once, not done again and not left to its deadline."""
    monkeypatch.setattr(host_stream, "KEPT_BYTES", 300)
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=1, heartbeat_timeout_s=120))
    rank = CoordinatorClient(server.address, call_timeout_s=10.0)
    try:
        await rank.join(host_id="h", peer_address="127.0.0.1:7000", instance_id="i0", timeout_s=20)
        assert rank.membership is not None
        await rank.kv_set("uid", b"u" * 200)
        get = pb.KVGetRequest(epoch=rank.membership.epoch, key="uid", wait=True, timeout_s=10)
        stream = rank.host_calls()
        await stream.write(pb.HostCall(session="s"))
        assert server.lanes is not None
        assert await asyncio.wait_for(answer_of(stream), 30) == pb.HostAnswer(lane_port=server.lanes.port)
        for call_id in (1, 2):  # the second answer pushes the first out of the 300 bytes kept
            await stream.write(pb.HostCall(call_id=call_id, kv_get=get))
            answer = await asyncio.wait_for(answer_of(stream), 30)
            assert (answer.call_id, answer.value.value) == (call_id, b"u" * 200), answer
        await stream.write(pb.HostCall(call_id=2, resent=True, kv_get=get))
        assert (await asyncio.wait_for(answer_of(stream), 30)).value.value == b"u" * 200
        await stream.write(pb.HostCall(call_id=1, resent=True, kv_get=get))
        lost = await asyncio.wait_for(answer_of(stream), 30)
        assert (lost.call_id, lost.error.code) == (1, "UNAVAILABLE") and "lost" in lost.error.details, lost
        stream.cancel()
    finally:
        await rank.close()
        await server.stop(grace=0.1)


async def test_a_host_call_the_coordinator_does_not_answer_fails_at_its_deadline_and_the_stream_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent's own deadline on each call of its stream: a call left unanswered fails typed
    (DEADLINE_EXCEEDED) at its deadline, not later, and the calls after it are answered on the same stream."""

    def never(*args: Any) -> list[Callable[[int], None]]:
        return [lambda waiter: None]  # an arrival the state never hears of: never settled

    monkeypatch.setattr(host_stream, "barrier_arrivals", never)
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=1, heartbeat_timeout_s=120))
    rank = CoordinatorClient(server.address, call_timeout_s=10.0)
    upstream = CoordinatorClient(server.address, call_timeout_s=10.0)
    stream = HostCallStream(upstream)
    try:
        await rank.join(host_id="h", peer_address="127.0.0.1:7000", instance_id="i0", timeout_s=20)
        assert rank.membership is not None
        epoch = rank.membership.epoch
        barrier = pb.BarrierHostRequest(epoch=epoch, name="b", arriving=[0], timeout_s=60)
        started = time.monotonic()
        with pytest.raises(Relayed) as failed:
            await asyncio.wait_for(stream.call(pb.HostCall(barrier=barrier), 0.5), 30)
        assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED, failed.value
        assert 0.4 < time.monotonic() - started < 10.0
        kv_set = pb.HostCall(kv_set=pb.KVSetRequest(epoch=epoch, key="k", value=b"v"))
        answer = await asyncio.wait_for(stream.call(kv_set, 10.0), 30)
        assert not answer.HasField("error"), answer
        assert await rank.kv_get("k") == b"v"
    finally:
        await stream.close()
        await upstream.close()
        await rank.close()
        await server.stop(grace=0.1)
