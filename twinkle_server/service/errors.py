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


MAX_MESSAGE_BYTES = 2048
"""A status message travels as a percent-encoded header (at most 3 bytes for each of its
UTF-8 bytes) within a reply's metadata, which gRPC clients take up to 8 KiB (a soft
limit, refused at random past it, always past 16 KiB); past it the client gets "Stream
removed" and not the error. Messages echo what was sent (a name, a path) before saying what is wrong
with it, so a longer one loses its middle: the field's name and the reason stay."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message of `exc` (the message within `MAX_MESSAGE_BYTES`)."""
    code, message = _status(exc)
    raw = message.encode()
    if len(raw) > MAX_MESSAGE_BYTES:
        half = MAX_MESSAGE_BYTES // 2
        head = raw[:half].decode(errors="ignore")
        tail = raw[-half:].decode(errors="ignore")
        cut = len(raw) - len(head.encode()) - len(tail.encode())
        message = f"{head} [... {cut} bytes cut ...] {tail}"
    return code, message


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, EngineError):
        return _CODES.get(exc.category, grpc.StatusCode.INTERNAL), str(exc)
    if isinstance(exc, WireError | PathError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, MemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, "server out of memory for this request"
    log.exception("internal error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}"

