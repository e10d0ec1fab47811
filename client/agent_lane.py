"""The rank lane: a host's ranks' barriers and unique-id calls to their agent on a Unix socket, without gRPC.

The agent serves its ranks the coordinator's gRPC service on ``agent.sock`` (``agent_server.py``); beside it,
``lane.sock`` takes the calls a rank waits on (a barrier arrival, a waiting get, a set) as host-lane frames
(``protos/host_lane.py``): a ``HostLaneHello`` with the job token first (compared in constant time), then one
``HostCall`` per call (the rank's barrier as a ``BarrierHostRequest`` naming only itself), each answered by the
``HostAnswer`` with its call id; a connection without its hello within ``HELLO_TIMEOUT_S`` is closed. The agent
runs each call through the very methods its gRPC service runs (``HostAgent.Barrier`` / ``KVGet`` / ``KVSet``), so
batching, sharing and errors are the same; a failure goes back as a ``CallError`` carrying what the gRPC error's
status and trailers carry, and the rank raises the same typed error (``node/coord_lane.py``). Why: on grpc aio each call and answer crosses gRPC's threads on both
sides; on a socket the event loops read and write it themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from paramplane.agent_relay import Relayed
from paramplane.host_agent import HostAgent
from paramplane.node.coord_client import MAX_MESSAGE_BYTES
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos.auth import call_error_of
from paramplane.protos.host_lane import (
    HELLO_BYTES,
    HELLO_TIMEOUT_S,
    FrameProtocol,
    FrameServer,
    LaneClosed,
    check_hello,
    decode,
)

log = logging.getLogger("paramplane.agent")

LANE_NAME = "lane.sock"
"""The rank lane's socket, beside the agent's gRPC socket in its private folder."""
_OK = pb.BarrierHostResponse(errors=[pb.CallError()])


class _Context:
    """What the agent's service methods use of a gRPC context, for one lane call."""

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s

    def time_remaining(self) -> float:
        return max(self._deadline - time.monotonic(), 0.0)

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        raise Relayed(code, details, tuple(trailing_metadata))


def call_error(error: Relayed) -> pb.CallError:
    """``error`` as the lane carries it: its status, details and what its trailers say."""
    return call_error_of(error.code.name, error.details, error.trailers)


class _Connection:
    """One rank's lane: its hello, then its calls, each run in its own task."""

    def __init__(self, lanes: RankLanes) -> None:
        self._lanes = lanes
        self.conn = FrameProtocol(HELLO_BYTES, self._frame, self._closed, HELLO_TIMEOUT_S)
        self._hello = False
        self._tasks: set[asyncio.Task[None]] = set()

    def _frame(self, data: bytes) -> None:
        if not self._hello:
            check_hello(data, self._lanes.token)
            self.conn.greeted()
            self._hello = True
            self.conn.max_bytes = MAX_MESSAGE_BYTES
            self.conn.write(pb.HostAnswer())  # the acknowledgement: call id 0
            return
        task = asyncio.ensure_future(self._run(decode(pb.HostCall(), data)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, call: pb.HostCall) -> None:
        agent, kind = self._lanes.agent, call.WhichOneof("call")
        try:
            if kind == "barrier" and len(call.barrier.arriving) == 1:
                b = call.barrier
                request = pb.BarrierRequest(
                    epoch=b.epoch, name=b.name, rank=b.arriving[0], ranks=b.ranks, timeout_s=b.timeout_s
                )
                ctx: Any = _Context(b.timeout_s + 5.0)
                await agent.Barrier(request, ctx)
                answer = pb.HostAnswer(call_id=call.call_id, barrier=_OK)
            elif kind == "kv_get" and call.kv_get.wait:
                ctx = _Context(call.kv_get.timeout_s + 5.0)
                value = await agent.KVGet(call.kv_get, ctx)
                answer = pb.HostAnswer(call_id=call.call_id, value=value)
            elif kind == "kv_set":
                ctx = _Context(30.0)
                await agent.KVSet(call.kv_set, ctx)
                answer = pb.HostAnswer(call_id=call.call_id)
            else:
                details = f"lane call {call.call_id}: not a barrier of one rank, a waiting get or a set"
                raise Relayed(grpc.StatusCode.INVALID_ARGUMENT, details)
        except Relayed as e:
            answer = pb.HostAnswer(call_id=call.call_id, error=call_error(e))
        except grpc.aio.AioRpcError as e:
            answer = pb.HostAnswer(call_id=call.call_id, error=call_error(Relayed.of(e)))
        except Exception as e:  # a bug: the rank still gets an answer, not a wait until its deadline
            log.exception("rank lane call %d failed", call.call_id)
            answer = pb.HostAnswer(call_id=call.call_id, error=pb.CallError(code="INTERNAL", details=repr(e)))
        try:
            self.conn.write(answer)
        except ConnectionResetError:
            pass  # the rank went away

    def _closed(self, error: BaseException | None) -> None:
        self._lanes.conns.discard(self.conn)
        if isinstance(error, LaneClosed):
            log.warning("rank lane closed: %s", error)
        for task in self._tasks:
            task.cancel()  # the rank went away: its waits are withdrawn, as for a cancelled gRPC call


class RankLanes:
    """The agent's rank lane listener (on the agent's loop)."""

    def __init__(self, agent: HostAgent, token: str | None) -> None:
        self.agent, self.token = agent, token
        self._frames = FrameServer(lambda: _Connection(self).conn)
        self.conns = self._frames.conns

    async def start(self, path: str) -> None:
        await self._frames.start_unix(path)

    async def stop(self) -> None:
        await self._frames.stop()
