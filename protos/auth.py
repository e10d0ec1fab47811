"""What both planes share on the wire: the job-token metadata and the one auth interceptor.

Kept beside the protos because the coordinator and the node runtime may both
import from here and from nowhere else of ours (see DESIGN.md, Layout).
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from paramplane.protos import coordinator_pb2 as pb

TOKEN_METADATA_KEY = "x-paramplane-token"
# Trailing metadata of coordinator errors: which rank an abort names, that a barrier's ranks disagreed, and
# which rank a barrier waited for in vain (it left the world).
ABORT_RANK_METADATA_KEY = "x-paramplane-abort-rank"
MISMATCH_METADATA_KEY = "x-paramplane-mismatch"
LEFT_RANK_METADATA_KEY = "x-paramplane-left-rank"
# Health probes carry no token (load balancers, orchestrators).
UNAUTHENTICATED_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries ``token`` (empty when there is none)."""
    return ((TOKEN_METADATA_KEY, token),) if token else ()


def _rejecting(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)
        yield  # pragma: no cover - makes this an async generator

    # The request is never decoded: a refused call cannot reach the protobuf parser either.
    kw = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)


def _decoding(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """``handler`` with its request decoded inside the call, so undecodable bytes end as INVALID_ARGUMENT
    (grpc.aio would answer UNKNOWN and log a traceback for a deserializer that raises)."""
    decode = handler.request_deserializer
    if decode is None or not (handler.unary_unary or handler.unary_stream):
        return handler

    async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return decode(raw)
        except Exception:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed {method} request ({len(raw)} bytes)"
            )

    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            result = inner(await parse(raw, context), context)
            return await result if inspect.isawaitable(result) else result

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=None, response_serializer=handler.response_serializer
        )
    inner_stream = handler.unary_stream

    async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        result = inner_stream(await parse(raw, context), context)
        if inspect.isawaitable(result):
            await result  # a servicer that writes with context.write
            return
        async for item in result:
            yield item

    return grpc.unary_stream_rpc_method_handler(
        stream, request_deserializer=None, response_serializer=handler.response_serializer
    )


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call whose metadata lacks the job token (UNAUTHENTICATED), and decodes admitted
    requests inside the call so that malformed bytes get INVALID_ARGUMENT.

    With ``token=None`` every call is admitted. The comparison is constant-time
    and the token never appears in an error message.
    """

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        if self._token is None or details.method in UNAUTHENTICATED_METHODS:
            return _decoding(handler, details.method)
        sent = dict(details.invocation_metadata or ()).get(TOKEN_METADATA_KEY)
        if sent is None:
            return _rejecting(
                handler, "no job token: set PARAMPLANE_TOKEN (or --token-file) to the job's token"
            )
        if not hmac.compare_digest(str(sent).encode(), self._token):
            return _rejecting(handler, "wrong job token: every rank must use the coordinator's token")
        return _decoding(handler, details.method)


def call_error_trailers(error: pb.CallError) -> tuple[tuple[str, str], ...]:
    """The trailing metadata a failed gRPC call carries for ``error``: the rank an abort names, that a barrier's
    ranks disagreed, or the rank a barrier waited for in vain."""
    if error.code == "ABORTED":
        return ((ABORT_RANK_METADATA_KEY, str(error.abort_rank)),)
    if error.mismatch:
        return ((MISMATCH_METADATA_KEY, "1"),)
    if error.left_rank >= 0:
        return ((LEFT_RANK_METADATA_KEY, str(error.left_rank)),)
    return ()


def call_error_of(code: str, details: str, trailers: tuple[tuple[str, str], ...]) -> pb.CallError:
    """A failed call (its status code's name, details, trailing metadata) as a ``CallError``."""
    by_key = dict(trailers)
    return pb.CallError(
        code=code,
        details=details,
        abort_rank=int(by_key.get(ABORT_RANK_METADATA_KEY, -1)),
        left_rank=int(by_key.get(LEFT_RANK_METADATA_KEY, -1)),
        mismatch=bool(by_key.get(MISMATCH_METADATA_KEY)),
    )
