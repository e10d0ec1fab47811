"""The lanes: host agents' calls to the coordinator on plain TCP (coordinator/host_lane.py,
client/agent_stream.py), and ranks' calls to their agent on a Unix socket (client/agent_lane.py,
node/coord_lane.py).

Real coordinators on 127.0.0.1 port 0, real agents. Agents move their host calls to the lane and lose nothing
when it breaks; the lane refuses a wrong token, oversized, undecodable and late frames, and keeps serving; an
agent that cannot reach the lane, or a coordinator that serves none, keeps the calls on gRPC. Ranks wait on
their agent through its rank lane with the typed errors of the gRPC calls, and use the gRPC calls where the
agent serves no lane.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import struct
from typing import Any

import pytest

from paramplane import CollectiveMismatch, CollectiveTimeout, WorldAborted, agent_lane
from paramplane.agent_server import AgentThread
from paramplane.coordinator import host_lane
from paramplane.coordinator.server import CoordinatorConfig, CoordinatorServer
from paramplane.host_agent import HostAgent
from paramplane.node.coord_client import CoordinatorClient
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos.host_lane import frame
from tests.control.test_host_stream import _InProcess, calls, joiners, served_world, until

TOKEN = "lane-test-token"


async def test_agents_calls_go_on_the_lane_and_a_broken_lane_loses_no_release() -> None:
    async with served_world(num_hosts=2, per_host=2) as (server, status, ranks):
        await asyncio.wait_for(asyncio.gather(*(r.barrier("b", timeout_s=20) for r in ranks)), 30)
        waiting = [asyncio.ensure_future(r.kv_get("uid", wait=True, timeout_s=20)) for r in ranks[1:]]
        await ranks[0].kv_set("uid", b"id")
        assert await asyncio.wait_for(asyncio.gather(*waiting), 30) == [b"id"] * 3
        c = await calls(status)
        # Each agent moved its session to a lane, and every host call (the barrier, one per host, the set, the
        # gets) came on the lanes.
        host_calls = sum(n for name, n in c.items() if name.startswith("HostCalls."))
        assert c.get("HostLane") == 2 and c.get("HostLane.calls") == host_calls >= 3, c
        assert c.get("HostCalls.barrier") == 2 and not c.get("BarrierHost") and not c.get("KVSet"), c

        # The coordinator drops both lanes while host 0's ranks wait at a barrier: host 0's agent opens its
        # lane again at once (a gRPC stream, then the lane) and sends the arrival again, host 1's (no call
        # waiting) at its next call; the release reaches every rank.
        early = [asyncio.ensure_future(r.barrier("again", timeout_s=20)) for r in ranks[:2]]
        await until(lambda: _count(status, "HostCalls.barrier", 3), "host 0's arrival")
        assert server.lanes is not None and len(server.lanes.conns) == 2
        for conn in list(server.lanes.conns):
            conn.close()
        await until(lambda: _count(status, "HostLane", 3), "host 0's agent back on a lane")
        await asyncio.wait_for(asyncio.gather(*(r.barrier("again", timeout_s=20) for r in ranks[2:])), 30)
        assert await asyncio.wait_for(asyncio.gather(*early), 30) == [None, None]
        c = await calls(status)
        assert c.get("HostCalls.barrier") == 4, f"an arrival sent again was done twice: {c}"
        assert c.get("HostLane") == 4, c


async def test_the_lane_refuses_bad_tokens_and_frames_and_keeps_serving(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(host_lane, "HELLO_TIMEOUT_S", 0.3)
    server = await CoordinatorServer.start(
        CoordinatorConfig(port=0, world_size=1, token=TOKEN, heartbeat_timeout_s=120)
    )
    status = CoordinatorClient(server.address, token=TOKEN, call_timeout_s=10.0)
    assert server.lanes is not None
    port = server.lanes.port
    hello = pb.HostLaneHello(token=TOKEN, session="s")
    try:
        with caplog.at_level(logging.WARNING, logger="paramplane.coordinator"):
            refused = {
                "a wrong token": frame(pb.HostLaneHello(token="not-it", session="s")),
                "a missing token": frame(pb.HostLaneHello(session="s")),
                "a hello over the size limit": struct.pack("<I", 1 << 30),
                "a hello that is not one": struct.pack("<I", 3) + b"\xff\xff\xff",
                "a call over the size limit": frame(hello) + struct.pack("<I", (16 << 20) + 1),
                "a call that is not one": frame(hello) + struct.pack("<I", 2) + b"\x0a\xff",
                "no hello in time": b"",
            }
            for what, data in refused.items():
                assert await _closed_after(port, data), f"{what}: the connection stayed open"
            rng = random.Random(0)
            for _ in range(50):  # garbage: random sizes and bytes
                data = rng.randbytes(rng.randrange(1, 64))
                assert await _closed_after(port, data)
        logged = caplog.text
        assert TOKEN not in logged and "not-it" not in logged
        for reason in ("wrong or missing token", "over the limit", "not a HostLaneHello", "not a HostCall"):
            assert reason in logged, reason
        c = await _calls(status)
        assert c.get("HostLane") == 2, c  # only the two good hellos had their sessions taken

        # The same lane still takes a good session and answers its calls.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(frame(hello))
            assert (await _answer(reader)).call_id == 0  # the session's acknowledgement
            writer.write(frame(pb.HostCall(call_id=1, kv_set=pb.KVSetRequest(epoch=99, key="k", value=b"v"))))
            answer = await _answer(reader)
            assert answer.call_id == 1 and answer.error.code, answer  # epoch 99 is no world: a typed error
        finally:
            writer.close()
        assert (await _calls(status)).get("HostLane") == 3
    finally:
        await status.close()
        await server.stop(grace=0.1)


@pytest.mark.parametrize("lane", ["off", "unreachable"])
async def test_without_a_reachable_lane_the_agent_keeps_its_calls_on_grpc(
    lane: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = CoordinatorConfig(port=0, world_size=2, heartbeat_timeout_s=120, host_lane_port=None)
    if lane == "unreachable":
        config.host_lane_port = 0
    server = await CoordinatorServer.start(config)
    if lane == "unreachable":
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        server._service.lane_port = closed
    up, status = (CoordinatorClient(server.address, call_timeout_s=10.0) for _ in range(2))
    agent = HostAgent(up, host_id="host-a", num_local=2)
    ctx: Any = _InProcess()
    try:
        with caplog.at_level(logging.WARNING, logger="paramplane.agent"):
            joined = await asyncio.wait_for(
                asyncio.gather(*(agent.join(j, 20) for j in joiners("host-a", [0, 1]))), 30
            )
            epoch = joined[0][0].epoch
            arrivals = [
                agent.Barrier(pb.BarrierRequest(epoch=epoch, name="b", rank=r, timeout_s=20), ctx)
                for r in (0, 1)
            ]
            assert await asyncio.wait_for(asyncio.gather(*arrivals), 30) == [pb.BarrierResponse()] * 2
        c = await _calls(status)
        assert c.get("HostCalls.barrier") == 1 and not c.get("HostLane"), c
        assert ("stay on gRPC" in caplog.text) == (lane == "unreachable"), caplog.text
    finally:
        await agent.stop()
        await status.close()
        await server.stop(grace=0.1)


async def test_ranks_wait_on_their_agents_lane_with_the_grpc_calls_typed_errors() -> None:
    agents: list[AgentThread] = []
    async with served_world(num_hosts=2, per_host=2, agents_out=agents) as (_, _, ranks):
        await asyncio.wait_for(asyncio.gather(*(r.barrier("b", timeout_s=20) for r in ranks)), 30)
        waiting = [asyncio.ensure_future(r.kv_get("uid", wait=True, timeout_s=20)) for r in ranks[1:]]
        await ranks[0].kv_set("uid", b"id")
        assert await asyncio.wait_for(asyncio.gather(*waiting), 30) == [b"id"] * 3
        for agent in agents:  # none of those calls reached the agents' gRPC service
            assert agent.agent is not None
            c = agent.agent.num_calls
            assert not c.get("Barrier") and not c.get("KVGet") and not c.get("KVSet"), dict(c)
        # The gRPC calls' typed errors, through the lanes: a timeout, ranks that disagree on a barrier's
        # participants, an abort.
        timed = await asyncio.wait_for(
            asyncio.gather(*(r.barrier("t", timeout_s=0.5) for r in ranks[:3]), return_exceptions=True), 30
        )
        assert all(isinstance(t, CollectiveTimeout) and "missing ranks" in str(t) for t in timed), timed
        mismatched = await asyncio.wait_for(
            asyncio.gather(
                ranks[0].barrier("m", ranks=[0, 1], timeout_s=10),
                ranks[1].barrier("m", ranks=[0, 1, 2], timeout_s=10),
                return_exceptions=True,
            ),
            30,
        )
        assert all(isinstance(m, CollectiveMismatch) for m in mismatched), mismatched
        gets = [asyncio.ensure_future(r.kv_get("never", wait=True, timeout_s=20)) for r in ranks[:2]]
        await ranks[3].abort("rank 3 gives up")
        outcomes = await asyncio.wait_for(asyncio.gather(*gets, return_exceptions=True), 30)
        assert all(isinstance(o, WorldAborted) and o.rank == 3 for o in outcomes), outcomes


async def test_fail_waits_ends_a_ranks_lane_waits_at_once_and_the_others_are_released() -> None:
    async with served_world(num_hosts=1, per_host=3) as (_, _, ranks):
        await asyncio.wait_for(asyncio.gather(*(r.barrier("b", timeout_s=20) for r in ranks)), 30)
        waiting = ranks[0]
        barrier = asyncio.ensure_future(waiting.barrier("x", timeout_s=60))
        get = asyncio.ensure_future(waiting.kv_get("never", wait=True, timeout_s=60))

        async def on_the_lane() -> bool:  # both calls written to the agent's lane and waiting for answers
            return len(waiting._waits) == 2

        await until(on_the_lane, "rank 0's waits on its lane")
        waiting.fail_waits(WorldAborted("the world ended", rank=2))
        outcomes = await asyncio.wait_for(asyncio.gather(barrier, get, return_exceptions=True), 10)
        assert all(isinstance(o, WorldAborted) and o.rank == 2 for o in outcomes), outcomes
        assert not waiting._waits
        with pytest.raises(WorldAborted):  # and every later wait
            await asyncio.wait_for(waiting.barrier("y", timeout_s=60), 10)
        # Rank 0's arrival at "x" was counted by the agent: the two others are released with it.
        await asyncio.wait_for(asyncio.gather(*(r.barrier("x", timeout_s=20) for r in ranks[1:])), 30)


async def test_ranks_of_an_agent_without_a_lane_use_its_grpc_service() -> None:
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=2, heartbeat_timeout_s=120))
    agent = AgentThread(server.address, host_id="h", num_local=2, token=None)
    socket_address = agent.start()
    ranks = [CoordinatorClient(socket_address, call_timeout_s=10.0) for _ in range(2)]
    os.unlink(agent.lane_path)  # an agent that serves no lane (as one before it did)
    try:
        joins = (
            r.join(host_id="h", peer_address=f"127.0.0.1:{7000 + i}", instance_id=f"i{i}", timeout_s=20)
            for i, r in enumerate(ranks)
        )
        await asyncio.wait_for(asyncio.gather(*joins), 30)
        await asyncio.wait_for(asyncio.gather(*(r.barrier("b", timeout_s=20) for r in ranks)), 30)
        assert agent.agent is not None and agent.agent.num_calls.get("Barrier") == 2
    finally:
        for r in ranks:
            await r.close()
        agent.stop()
        await server.stop(grace=0.1)


async def test_the_rank_lane_refuses_a_wrong_token_garbage_and_silence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_lane, "HELLO_TIMEOUT_S", 0.3)
    server = await CoordinatorServer.start(CoordinatorConfig(port=0, world_size=1, token=TOKEN))
    agent = AgentThread(server.address, host_id="h", num_local=1, token=TOKEN)
    agent.start()
    try:
        refused = {
            "a wrong token": frame(pb.HostLaneHello(token="not-it")),
            "a hello that is not one": struct.pack("<I", 3) + b"\xff\xff\xff",
            "no hello in time": b"",  # connects and says nothing
        }
        for what, data in refused.items():
            reader, writer = await asyncio.open_unix_connection(agent.lane_path)
            writer.write(data)
            assert await asyncio.wait_for(reader.read(), 10) == b"", f"{what}: the lane answered"
            writer.close()
        reader, writer = await asyncio.open_unix_connection(agent.lane_path)
        writer.write(frame(pb.HostLaneHello(token=TOKEN)))
        assert (await _answer(reader)).call_id == 0  # the right token is acknowledged
        writer.close()
    finally:
        agent.stop()
        await server.stop(grace=0.1)


async def _closed_after(port: int, data: bytes) -> bool:
    """Whether the lane closes a connection that sent ``data`` within 10 s (after the acknowledgement of a good
    hello, if one came first)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await asyncio.wait_for(reader.read(), 10)  # everything until the end of the connection
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        writer.close()


async def _answer(reader: asyncio.StreamReader) -> pb.HostAnswer:
    (size,) = struct.unpack("<I", await asyncio.wait_for(reader.readexactly(4), 10))
    return pb.HostAnswer.FromString(await asyncio.wait_for(reader.readexactly(size), 10))


async def _calls(client: CoordinatorClient) -> dict[str, int]:
    return dict((await client.status()).num_calls)


async def _count(client: CoordinatorClient, name: str, value: int) -> bool:
    return (await _calls(client)).get(name) == value
