"""The host agent's relays: the calls a host agent passes to the coordinator one for one, as the rank sent them.

Their answer or error (code, details, trailers) goes back untouched (``Relayed``); waiting gets of one key
share one upstream call (a group's unique id on every local rank), and a local rank's set of that key, once
the coordinator took it, answers them all: a per-host unique id costs the coordinator one call per host, not
two. ``HostAgent`` (``host_agent.py``) adds the calls it batches or aggregates per host: joins, heartbeats,
watch streams and barriers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

import grpc

from paramplane.node.coord_client import WAIT_MARGIN_S, CoordinatorClient
from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos import coordinator_pb2_grpc as pb_grpc
from paramplane.protos.auth import call_error_trailers

KV_WAIT_SLACK_S = 1.0
"""A waiting get joins another's upstream call for the same key when that call's deadline is at most this much
earlier than its own."""

_F = TypeVar("_F", bound="asyncio.Future[Any]")


def quiet(fut: _F) -> _F:
    """``fut``, its exception marked retrieved: a rank that went away (its call cancelled) leaves no warning."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


class Relayed(Exception):
    """A call's failure to hand back to the rank as its own gRPC error."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(details)
        self.code, self.details, self.trailers = code, details, trailers

    @classmethod
    def of(cls, e: grpc.aio.AioRpcError) -> Relayed:
        pairs = tuple((k, str(v)) for k, v in (e.trailing_metadata() or ()))
        return cls(e.code(), e.details() or "", pairs)

    @classmethod
    def of_call(cls, error: pb.CallError) -> Relayed:
        return cls(grpc.StatusCode[error.code], error.details, call_error_trailers(error))


class RelayServicer(pb_grpc.CoordinatorServicer):
    """The Coordinator service relaying each call upstream as it came (``upstream``: the agent's connection)."""

    def __init__(self, upstream: CoordinatorClient) -> None:
        self._up = upstream
        self._kv_waits: dict[tuple[int, str], tuple[float, asyncio.Task[Any]]] = {}
        self._kv_waiting: dict[tuple[int, str], list[asyncio.Future[Any]]] = {}  # the waiting ranks, per key
        self._kv_sets: dict[tuple[int, str], tuple[bytes, asyncio.Task[Any]]] = {}  # local sets in flight
        self._tasks: set[asyncio.Task[Any]] = set()

    def _spawn(self, work: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return quiet(task)

    @staticmethod
    async def _answer(context: grpc.aio.ServicerContext, work: Any) -> Any:
        try:
            return await work
        except grpc.aio.AioRpcError as e:
            error = Relayed.of(e)
        except Relayed as e:
            error = e
        await context.abort(error.code, error.details, trailing_metadata=error.trailers)

    @staticmethod
    def _left_s(context: grpc.aio.ServicerContext, default: float = 30.0) -> float:
        left = context.time_remaining()
        return default if left is None else max(left, 0.001)

    # -- waiting gets -----------------------------------------------------------------------------
    async def KVGet(self, request: pb.KVGetRequest, context: grpc.aio.ServicerContext) -> pb.KVGetResponse:
        if not request.wait:
            return await self._answer(
                context, self._up.relay("KVGet", request, timeout_s=self._left_s(context))
            )
        # Waiting gets of one key (a group's unique id on every local rank) share one upstream call.
        key = (request.epoch, request.key)
        deadline = time.monotonic() + request.timeout_s
        shared = self._kv_waits.get(key)
        if shared is None or shared[1].done() or shared[0] + KV_WAIT_SLACK_S < deadline:
            task = self._spawn(self._shared_get(key, request))
            shared = self._kv_waits[key] = (deadline, task)
            task.add_done_callback(lambda done: self._forget_wait(key, done))
        # This rank's own future, told when the shared call ends or a local set of the key is taken (no shield:
        # a rank that goes away cancels only its own); one wake-up per rank, then the value or the error.
        mine: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def tell(done: asyncio.Task[Any]) -> None:
            if not mine.done():
                mine.set_result(done)

        shared[1].add_done_callback(tell)
        waiting = self._kv_waiting.setdefault(key, [])
        waiting.append(mine)
        try:
            outcome = await mine
        finally:
            waiting.remove(mine)
            if not waiting and self._kv_waiting.get(key) is waiting:
                del self._kv_waiting[key]
        if isinstance(outcome, pb.KVGetResponse):
            return outcome
        return await self._answer(context, outcome)

    async def _shared_get(self, key: tuple[int, str], request: pb.KVGetRequest) -> Any:
        # A local set of the key in flight (the host's first rank publishing its group's id) answers without
        # an upstream get, once the coordinator took it; a refused set leaves the get to the coordinator.
        setting = self._kv_sets.get(key)
        if setting is not None:
            started = time.monotonic()
            done, _ = await asyncio.wait({setting[1]}, timeout=request.timeout_s)
            if done and not setting[1].cancelled() and setting[1].exception() is None:
                return pb.KVGetResponse(found=True, value=setting[0])
            left = pb.KVGetRequest()
            left.CopyFrom(request)
            left.timeout_s = max(request.timeout_s - (time.monotonic() - started), 0.001)
            request = left
        return await self._kv_upstream("KVGet", request, request.timeout_s + WAIT_MARGIN_S)

    async def _kv_upstream(self, method: str, request: Any, timeout_s: float) -> Any:
        """A ``KVSet`` or waiting ``KVGet`` to the coordinator (``HostAgent``: on its host stream)."""
        return await self._up.relay(method, request, timeout_s=timeout_s)

    def _forget_wait(self, key: tuple[int, str], done: asyncio.Task[Any]) -> None:
        shared = self._kv_waits.get(key)
        if shared is not None and shared[1] is done:
            del self._kv_waits[key]

    async def KVSet(self, request: pb.KVSetRequest, context: grpc.aio.ServicerContext) -> Any:
        key = (request.epoch, request.key)
        task = self._spawn(self._kv_upstream("KVSet", request, self._left_s(context)))
        self._kv_sets[key] = (request.value, task)
        task.add_done_callback(lambda done: self._set_taken(key, request.value, done))
        return await self._answer(context, asyncio.shield(task))

    def _set_taken(self, key: tuple[int, str], value: bytes, done: asyncio.Task[Any]) -> None:
        """A local set ended: once the coordinator took it, the value answers this host's waiting gets of the
        key (each was concurrent with the set, so the value is one that key held while it waited)."""
        setting = self._kv_sets.get(key)
        if setting is not None and setting[1] is done:
            del self._kv_sets[key]
        if done.cancelled() or done.exception() is not None:
            return
        answer = pb.KVGetResponse(found=True, value=value)
        for mine in self._kv_waiting.get(key, ()):
            if not mine.done():
                mine.set_result(answer)

    # -- relayed as they came ---------------------------------------------------------------------
    async def _relay(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._answer(context, self._up.relay(method, request, timeout_s=self._left_s(context)))

    async def KVAdd(self, request: pb.KVAddRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._relay("KVAdd", request, context)

    async def KVCompareSet(self, request: pb.KVCompareSetRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._relay("KVCompareSet", request, context)

    async def KVDelete(self, request: pb.KVDeleteRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._relay("KVDelete", request, context)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._relay("Abort", request, context)

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._relay("Status", request, context)

    # -- host calls are the agent's own, upstream ------------------------------------------------------------
    async def _refuse(self, method: str, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, f"{method} goes to the coordinator, not to a host agent"
        )

    async def JoinHost(self, request: pb.JoinHostRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._refuse("JoinHost", context)

    async def HeartbeatHost(self, request: pb.HeartbeatHostRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._refuse("HeartbeatHost", context)

    async def BarrierHost(self, request: pb.BarrierHostRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._refuse("BarrierHost", context)

    async def HostCalls(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[override]
        return await self._refuse("HostCalls", context)
