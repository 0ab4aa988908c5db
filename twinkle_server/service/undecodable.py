"""Bytes that do not parse as the RPC's request message answer INVALID_ARGUMENT.

Left to itself, gRPC's asyncio server reports a request that fails to deserialize as
UNKNOWN ("unexpected DecodeError raised by servicer method") and logs a traceback for
each one, so a client sending garbage could fill the log and learn nothing. This
interceptor decodes each request itself: a message that does not parse becomes a marker
that the handler's wrapper turns into INVALID_ARGUMENT naming the expected type, before
any servicer code runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    def __init__(self, type_name: str, error: DecodeError) -> None:
        self.message = f"request: not a valid {type_name} message ({error})"


def _deserializer(original: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    type_name = getattr(getattr(original, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "request"

    def decode(data: bytes) -> Any:
        try:
            return original(data)
        except DecodeError as exc:
            return _Undecodable(type_name, exc)
    return decode


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
                   ) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


def _guard(kind: str, behavior: Callable) -> Callable:
    """`behavior` behind a check of its request(s), keeping its coroutine/generator form."""
    if kind == "unary_unary":
        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await behavior(request, context)
        return unary_unary
    if kind == "unary_stream":
        async def unary_stream(request: Any, context: grpc.aio.ServicerContext
                               ) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for item in behavior(request, context):
                yield item
        return unary_stream
    if kind == "stream_unary":
        async def stream_unary(requests: AsyncIterator[Any],
                               context: grpc.aio.ServicerContext) -> Any:
            return await behavior(_checked(requests, context), context)
        return stream_unary

    async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[Any]:
        async for item in behavior(_checked(requests, context), context):
            yield item
    return stream_stream


class RejectUndecodable(grpc.aio.ServerInterceptor):
    """Answer INVALID_ARGUMENT to any request bytes that are not the RPC's message, for
    the services whose full names start with `prefix` (ours, not health or reflection)."""

    def __init__(self, prefix: str = "/twinkle.") -> None:
        self.prefix = prefix

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if (handler is None or handler.request_deserializer is None
                or not handler_call_details.method.startswith(self.prefix)):
            return handler
        changes: dict[str, Any] = {
            "request_deserializer": _deserializer(handler.request_deserializer)}
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            if getattr(handler, kind) is not None:
                changes[kind] = _guard(kind, getattr(handler, kind))
        return handler._replace(**changes)
