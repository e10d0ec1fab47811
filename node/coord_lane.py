"""A rank's side of its host agent's rank lane (``client/agent_lane.py``): the calls it waits on, without gRPC.

Opened at the first such call (the agent's ``lane.sock`` beside its gRPC socket; none there: the gRPC calls
are used); a hello with the job token, then one ``HostCall`` per call, answered by the ``HostAnswer`` with its
id. Each call has its own deadline. A failure comes back as a ``CallError`` and is raised as the
``grpc.aio.AioRpcError`` the gRPC call would have raised (status, details, trailers), so the client maps it to
the same typed error. A lane that closes fails its waiting calls as UNAVAILABLE; the next call opens it again.
"""

from __future__ import annotations

import asyncio

import grpc

from paramplane.protos import coordinator_pb2 as pb
from paramplane.protos.auth import call_error_trailers
from paramplane.protos.host_lane import FrameProtocol, decode
from paramplane.protos.net import within

OPEN_TIMEOUT_S = 5.0
"""How long opening the lane (connect, hello, acknowledgement) may take."""


def rpc_error(code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()) -> Exception:
    """The error a gRPC call would raise with this status and these trailers."""
    no_metadata = grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, no_metadata, grpc.aio.Metadata(*trailers), details=details)


def error_of(error: pb.CallError) -> Exception:
    """A lane answer's ``CallError`` as the gRPC error it stands for."""
    code = (
        grpc.StatusCode[error.code] if error.code in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN
    )
    return rpc_error(code, error.details, call_error_trailers(error))


class RankLane:
    """One rank's lane to its agent (on the rank's client loop)."""

    def __init__(self, path: str, token: str | None, max_bytes: int) -> None:
        self._path, self._token, self._max = path, token, max_bytes
        self._conn: FrameProtocol | None = None
        self._opening: asyncio.Future[FrameProtocol] | None = None
        self._pending: dict[int, asyncio.Future[pb.HostAnswer]] = {}
        self._last_id = 0
        self._acked: asyncio.Future[None] | None = None

    async def call(self, message: pb.HostCall, timeout_s: float) -> pb.HostAnswer:
        """``message``'s answer (an answer carrying an error is raised as that error)."""
        conn = await self._open()
        loop = asyncio.get_running_loop()
        self._last_id += 1
        message.call_id = call_id = self._last_id
        fut: asyncio.Future[pb.HostAnswer] = loop.create_future()
        self._pending[call_id] = fut
        details = f"the host agent did not answer within {timeout_s:.1f} s"
        deadline = loop.call_later(
            timeout_s, _fail, fut, rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, details)
        )
        try:
            conn.write(message)
            answer = await fut
        except ConnectionResetError:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "the host agent's lane is closed") from None
        finally:
            deadline.cancel()
            self._pending.pop(call_id, None)
        if answer.HasField("error"):
            raise error_of(answer.error)
        return answer

    def open_soon(self) -> None:
        """Start opening the lane now (a failure shows at the first call, which tries again)."""
        if self._conn is None and self._opening is None:
            self._opening = asyncio.ensure_future(self._connect())
            self._opening.add_done_callback(_quiet)

    async def _open(self) -> FrameProtocol:
        if self._conn is not None:
            return self._conn
        opening = self._opening
        if opening is None or (opening.done() and (opening.cancelled() or opening.exception() is not None)):
            opening = self._opening = asyncio.ensure_future(self._connect())  # (again, after a failed one)
        try:
            return await asyncio.shield(opening)
        except (OSError, TimeoutError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"cannot open the host agent's lane: {e}") from None
        finally:
            if self._opening is not None and self._opening.done():
                self._opening = None

    async def _connect(self) -> FrameProtocol:
        acked: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._acked = acked
        conn = FrameProtocol(self._max, lambda data: self._frame(acked, data), self._closed)
        await within(
            asyncio.get_running_loop().create_unix_connection(lambda: conn, self._path), OPEN_TIMEOUT_S
        )
        conn.write(pb.HostLaneHello(token=self._token or ""))
        try:
            await within(asyncio.shield(acked), OPEN_TIMEOUT_S)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    def _frame(self, acked: asyncio.Future[None], data: bytes) -> None:
        answer = decode(pb.HostAnswer(), data)
        if answer.call_id == 0:
            if not acked.done():
                acked.set_result(None)
            return
        fut = self._pending.get(answer.call_id)
        if fut is not None and not fut.done():
            fut.set_result(answer)

    def _closed(self, error: BaseException | None) -> None:
        self._conn = None
        if self._acked is not None and not self._acked.done():
            self._acked.set_exception(ConnectionResetError(f"the lane refused the hello ({error or 'EOF'})"))
        closed = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the host agent's lane closed ({error or 'EOF'})")
        for fut in self._pending.values():
            _fail(fut, closed)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


def _quiet(fut: asyncio.Future[FrameProtocol]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: the next call reports it


def _fail(fut: asyncio.Future[pb.HostAnswer], error: Exception) -> None:
    if not fut.done():
        fut.set_exception(error)
