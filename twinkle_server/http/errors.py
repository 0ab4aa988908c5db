"""The one mapping from internal failures to HTTP statuses and the SDK's failure bodies.

The runtime raises the one error family (`twinkle_server.engine.errors`); decoding a body
raises the codec's `WireError`/`PathError` or a `BadBody`. Two channels reach the stock
`tinker` SDK, and each status was chosen by what the SDK (0.38) does with it:

- a request refused at once answers an HTTP status, which `tinker._client` turns into
  its own exception: 400 `BadRequestError`, 401 `AuthenticationError`, 404
  `NotFoundError`, 429 `RateLimitError`, 5xx `InternalServerError`. `failed_precondition`
  is 412 (a plain `APIStatusError`), not 409: the SDK retries 408/409/429/5xx for up to
  five minutes (`InternalClientHolder.execute_with_retries`), and a precondition does
  not fix itself. 429 and 503 carry `x-should-retry: false`, so the SDK's base client
  raises at once where its own retry loop is not in the way.
- an op that failed after it was accepted answers `retrieve_future` with
  `RequestFailedResponse` (`{"error", "category"}`), raised by the SDK as
  `tinker.RequestFailedError` with category `user` (the request was wrong, or its caller
  cancelled it) or `server`.

`cancelled` (the caller cancelled the request or went away: a sample op stopped by
`cancel_future`) is 499, nginx's "client closed request": the client did it, and the SDK
retries none of it. 499 becomes a plain `APIStatusError`, which neither its base client
nor `execute_with_retries` retries (they retry 408/409/429/5xx) and its future poll
raises at once; 400 would say the request was malformed, 409 is retried for minutes,
410 makes the poll resend the original request. It mostly reaches the SDK through
`retrieve_future`, as category `user`.

The scheduler's refusals name seq_ids in the runtime's numbering, from 0 (what the gRPC
front's clients send); the SDK counts a training client's ops from 1 (`Front.op_ref`
subtracts one), so this front words them as the SDK counts (`NamesSeqIds.numbered`):
"seq_id: 0 must be at least 1; the model expects seq_id 1 next".
"""

from __future__ import annotations

import logging

from twinkle_server.engine.errors import EngineError, InvalidArgument, NamesSeqIds
from twinkle_wire import WireError
from twinkle_wire.paths import PathError

log = logging.getLogger(__name__)

STATUS = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "failed_precondition": 412,
    "resource_exhausted": 429,
    "cancelled": 499,
    "unavailable": 503,
}
USER_CATEGORIES = frozenset({"invalid_argument", "unauthenticated", "permission_denied",
                             "not_found", "failed_precondition", "resource_exhausted",
                             "cancelled"})
NO_RETRY_STATUSES = frozenset({429, 503})
SDK_FIRST_SEQ_ID = 1
"""The seq_id of a training client's first op, as the SDK counts them."""


class BadBody(InvalidArgument):
    """A request body the front cannot read (not JSON, not the SDK's protobuf, a field of
    the wrong type or out of range); `param` is the field, where one is to blame (the
    OpenAI routes' error body names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def category_of(exc: BaseException) -> str:
    if isinstance(exc, EngineError):
        return exc.category
    if isinstance(exc, WireError | PathError):
        return "invalid_argument"
    if isinstance(exc, MemoryError):
        return "resource_exhausted"
    return "internal"


def message_of(exc: BaseException) -> str:
    category = category_of(exc)
    if category == "internal":
        log.error("internal error", exc_info=exc)
        return f"internal error: {type(exc).__name__}"
    if isinstance(exc, MemoryError):
        return "server out of memory for this request"
    if isinstance(exc, NamesSeqIds):
        return exc.numbered(SDK_FIRST_SEQ_ID)
    return str(exc)


def status_for(exc: BaseException) -> tuple[int, dict[str, str], dict[str, str]]:
    """(HTTP status, JSON body, extra headers) for a request refused at once."""
    category = category_of(exc)
    status = STATUS.get(category, 500)
    headers = {"x-should-retry": "false"} if status in NO_RETRY_STATUSES else {}
    return status, {"detail": message_of(exc), "category": category}, headers


def failed_response(exc: BaseException) -> dict[str, str]:
    """`RequestFailedResponse` for an op that failed after it was accepted."""
    category = category_of(exc)
    return {"error": message_of(exc),
            "category": "user" if category in USER_CATEGORIES else "server"}
