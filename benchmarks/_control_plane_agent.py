"""The agent mode of ``control_plane.py``: simulated hosts, each with a real ``HostAgent`` for its ranks.

Each simulated host runs the launcher's agent (``paramplane.host_agent.HostAgent``, its own connection to the
coordinator through the project's ``CoordinatorClient``); its simulated ranks make the calls a rank's client
makes (join, heartbeat with progress every interval, watch, barriers, unique-id set / waiting get) on the
agent's service methods in process. The rank-to-agent hop (a Unix socket on a real host, on that host's own
cores) is left out: what is measured is the coordinator's side and the agents' batching. ``sim_agents_hop``
puts it in: each agent serves its Unix socket and each rank is a ``CoordinatorClient`` of it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from paramplane.agent_lane import LANE_NAME, RankLanes
from paramplane.benchmarks._control_plane_rounds import new_out, plan
from paramplane.coordinator.server import add_servicer
from paramplane.host_agent import HostAgent, Relayed
from paramplane.node.coord_client import CoordinatorClient
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos.auth import TokenAuthInterceptor
from paramplane.protos.net import prefer_control_latency


class _Context:
    """What the agent's service methods use of a gRPC server context, for an in-process caller."""

    def time_remaining(self) -> float | None:
        return None

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        raise Relayed(code, details, tuple(trailing_metadata))


async def sim_agents(
    address: str,
    n: int,
    my_ranks: list[tuple[int, int]],
    per_host: int,
    ready: Callable[[], None],
    steady_s: float,
    timeout_s: float,
    uid_bytes: bytes,
    rounds: int,
) -> dict[str, Any]:
    """The ranks ``my_ranks`` ((rank, host) pairs, whole hosts) through one agent per host."""
    prefer_control_latency()  # as ``paramplane launch`` does in the agents' process
    plain_channel = grpc.aio.insecure_channel

    def own_connection(target: str, options: Any = None, *args: Any, **kw: Any) -> Any:
        return plain_channel(target, [*(options or []), ("grpc.use_local_subchannel_pool", 1)], *args, **kw)

    grpc.aio.insecure_channel = own_connection  # one connection per host, as separate hosts have
    agents: dict[int, HostAgent] = {}
    for _, host in my_ranks:
        if host not in agents:
            upstream = CoordinatorClient(address, call_timeout_s=timeout_s)
            agents[host] = HostAgent(upstream, host_id=f"sim-host-{host}", num_local=per_host)
            agents[host].start()
    ctx: Any = _Context()
    await asyncio.get_running_loop().run_in_executor(None, ready)
    out = new_out(rounds)
    silent = n - 1
    stop_beats = asyncio.Event()
    tasks: list[asyncio.Future[Any]] = []
    watches: dict[int, asyncio.Future[Any]] = {}

    async def beat(agent: HostAgent, m: pb.JoinResponse) -> None:
        issued = 0
        while not (m.rank == silent and stop_beats.is_set()):
            issued += 1
            request = pb.HeartbeatRequest(
                epoch=m.epoch,
                rank=m.rank,
                progress=[pb.GroupProgress(group="world", issued=issued, completed=issued)],
            )
            await agent.Heartbeat(request, ctx)
            await asyncio.sleep(m.heartbeat_interval_s)

    async def watch(agent: HostAgent, m: pb.JoinResponse) -> None:
        events: AsyncIterator[pb.WatchEvent] = agent.Watch(pb.WatchRequest(epoch=m.epoch, rank=m.rank), ctx)
        async for event in events:
            if event.kind == pb.WatchEvent.ABORT:
                out["abort"].append(time.monotonic())
                return

    async def rank(r: int, host: int) -> None:
        agent = agents[host]
        t0 = time.monotonic()
        request = pb.JoinRequest(
            host_id=f"sim-host-{host}",
            peer_address=f"10.0.{host}.{r % per_host}:7000",
            rank_hint=r,
            world_size=n,
            instance_id=f"sim-{r}",
            pid=r,
        )
        m, _ = await agent.join(request, timeout_s)  # a rank parses its peer table on its own core: not here
        out["join"].append((t0, time.monotonic()))
        tasks.append(asyncio.ensure_future(beat(agent, m)))
        watches[r] = asyncio.ensure_future(watch(agent, m))
        tasks.append(watches[r])
        for op, name in plan(r, host, per_host, rounds, out):
            if op == "barrier":
                arrival = pb.BarrierRequest(epoch=m.epoch, name=name, rank=r, timeout_s=timeout_s)
                await agent.Barrier(arrival, ctx)
            elif op == "set":
                await agent.KVSet(pb.KVSetRequest(epoch=m.epoch, key=name, value=uid_bytes), ctx)
            else:
                get = pb.KVGetRequest(epoch=m.epoch, key=name, wait=True, timeout_s=timeout_s)
                await agent.KVGet(get, ctx)

    await asyncio.gather(*(rank(r, h) for r, h in my_ranks))
    out["steady"] = (time.monotonic(), time.monotonic() + steady_s)
    await asyncio.sleep(steady_s)  # the steady window: heartbeats and watches only
    out["stop"] = time.monotonic()
    stop_beats.set()
    alive = [w for r, w in watches.items() if r != silent]
    await asyncio.wait_for(asyncio.gather(*alive, return_exceptions=True), timeout_s)
    for t in tasks:
        t.cancel()
    for agent in agents.values():
        await agent.stop()
    return out


async def sim_agents_hop(
    address: str, n: int, hosts: int, procs: int, index: int, steady_s: float, rounds: int
) -> dict[str, Any]:
    """Simulator ``index``'s hosts, each a real agent serving a Unix socket (as ``paramplane launch`` does), and
    their ranks, each a ``CoordinatorClient`` of its host's socket: the rank-to-agent hop included."""
    from paramplane.benchmarks.control_plane import TIMEOUT_S, _my_ranks, _sim_paramplane

    prefer_control_latency()  # as ``paramplane launch`` does in the agents' process
    plain_channel = grpc.aio.insecure_channel

    def own_connection(target: str, options: Any = None, *args: Any, **kw: Any) -> Any:
        return plain_channel(target, [*(options or []), ("grpc.use_local_subchannel_pool", 1)], *args, **kw)

    grpc.aio.insecure_channel = own_connection  # one connection per host, as separate hosts have
    folder = tempfile.mkdtemp(prefix="pp-cp-agents-")
    agents: dict[int, HostAgent] = {}
    servers: list[grpc.aio.Server] = []
    lanes: list[RankLanes] = []
    sockets: dict[int, str] = {}
    try:
        for _, host in _my_ranks(n, hosts, procs, index):
            if host in agents:
                continue
            upstream = CoordinatorClient(address, call_timeout_s=TIMEOUT_S)
            agents[host] = HostAgent(upstream, host_id=f"sim-host-{host}", num_local=n // hosts)
            server = grpc.aio.server(interceptors=[TokenAuthInterceptor(None)])  # as agent_server.py serves
            add_servicer(agents[host], server, agents[host].num_calls)
            os.mkdir(f"{folder}/host-{host}")  # a folder per agent, as agent_server.py makes
            sockets[host] = f"unix:{folder}/host-{host}/agent.sock"
            server.add_insecure_port(sockets[host])
            await server.start()
            servers.append(server)
            lanes.append(RankLanes(agents[host], None))  # and its rank lane beside
            await lanes[-1].start(f"{folder}/host-{host}/{LANE_NAME}")
            agents[host].start()
        return await _sim_paramplane(address, n, hosts, procs, index, steady_s, rounds, agents=sockets)
    finally:
        for lane in lanes:
            await lane.stop()
        for server in servers:
            await server.stop(0)
        for agent in agents.values():
            await agent.stop()
        shutil.rmtree(folder, ignore_errors=True)
