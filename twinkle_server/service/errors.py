"""The one mapping from internal failures to gRPC status codes.

The runtime raises the one error family (`twinkle_server.engine.errors`); decoding the
wire raises the codec's `WireError`/`PathError`. `status_for` turns each into a code and
a message that names the field and the limit.
"""

from __future__ import annotations

import logging

import grpc

from twinkle_server.engine.errors import EngineError
from twinkle_wire import WireError
from twinkle_wire.paths import PathError

log = logging.getLogger(__name__)

_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "cancelled": grpc.StatusCode.CANCELLED,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, EngineError):
        return _CODES.get(exc.category, grpc.StatusCode.INTERNAL), str(exc)
    if isinstance(exc, WireError | PathError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "server out of memory for this request"
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"

