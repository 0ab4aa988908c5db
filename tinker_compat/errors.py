"""Tinker's exception classes for Twinkle's error categories.

`twinkle_client.errors` maps a gRPC status to one category; this module maps each category
to a class that subclasses BOTH the Tinker exception user code already catches and the
matching `twinkle_client.errors` class, so `except tinker.BadRequestError`,
`except tinker.TinkerError` and `except twinkle_client.errors.InvalidArgumentError` all work.

| category (gRPC status)                     | class (tinker base)               | HTTP |
|--------------------------------------------|-----------------------------------|------|
| invalid_argument (INVALID_ARGUMENT, OUT_OF_RANGE) | BadRequestError             | 400  |
| unauthenticated                            | AuthenticationError               | 401  |
| permission_denied                          | PermissionDeniedError             | 403  |
| not_found                                  | NotFoundError                     | 404  |
| failed_precondition (also ALREADY_EXISTS, ABORTED) | ConflictError             | 409  |
| resource_exhausted                         | RateLimitError                    | 429  |
| internal (anything else)                   | InternalServerError               | 500  |
| cancelled (CANCELLED)                      | APIStatusError                    | 499  |
| unavailable (UNAVAILABLE)                  | APIConnectionError                | none |
| deadline_exceeded                          | APITimeoutError                   | none |

The HTTP codes follow Google's gRPC-to-HTTP table (google/rpc/code.proto), except
FAILED_PRECONDITION: Google says 400, but a state conflict ("the model was unloaded")
is not a malformed request, and Tinker's ConflictError (409, "conflicts with the current
state of the resource") says what happened, so `except BadRequestError` does not catch it.
CANCELLED is 499 (nginx's "client closed request"), as the server's HTTP front answers
the stock SDK: a plain `APIStatusError`, which Tinker's retry loops do not retry.

Tinker's status errors carry an `httpx.Response`; ours describe the gRPC call honestly:
request `POST grpc://<target>/<Method>`, status = the HTTP equivalent above, body =
`{"category": ..., "message": ...}`. `str(exc)` and `exc.message` are the server's message.
"""

from __future__ import annotations

from typing import Any

import httpx
import tinker

from twinkle_client import errors as native
from twinkle_client.errors import ErrorFactory


def _request(target: str, method: str) -> httpx.Request:
    return httpx.Request("POST", f"grpc://{target or 'twinkle'}/{method}")


class _StatusMixin:
    """Builds the httpx request/response a Tinker `APIStatusError` needs from a gRPC call."""

    http_status: int = 500
    category: str = "internal"

    def __init__(self, message: str, *, method: str = "", target: str = "") -> None:
        request = _request(target, method)
        body = {"category": self.category, "message": message}
        response = httpx.Response(self.http_status, request=request, json=body)
        tinker.APIStatusError.__init__(self, message, response, body)  # type: ignore[arg-type]
        self.method = method
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.message, self.method, self.target)  # type: ignore[attr-defined]


class BadRequestError(_StatusMixin, tinker.BadRequestError, native.InvalidArgumentError):
    """The server refused the request as malformed or over a limit (INVALID_ARGUMENT)."""

    http_status, category = 400, "invalid_argument"


class AuthenticationError(_StatusMixin, tinker.AuthenticationError, native.AuthenticationError):
    """The API key is missing or unknown (UNAUTHENTICATED)."""

    http_status, category = 401, "unauthenticated"


class PermissionDeniedError(_StatusMixin, tinker.PermissionDeniedError,
                            native.PermissionDeniedError):
    """The key may not do this (PERMISSION_DENIED)."""

    http_status, category = 403, "permission_denied"


class NotFoundError(_StatusMixin, tinker.NotFoundError, native.NotFoundError):
    """No such run, model or checkpoint for this tenant; another tenant's looks the same."""

    http_status, category = 404, "not_found"


class ConflictError(_StatusMixin, tinker.ConflictError, native.FailedPreconditionError):
    """The model is not in a state for this op, e.g. unloaded (FAILED_PRECONDITION)."""

    http_status, category = 409, "failed_precondition"


class RateLimitError(_StatusMixin, tinker.RateLimitError, native.ResourceExhaustedError):
    """No free adapter slot, too many sessions or tokens (RESOURCE_EXHAUSTED)."""

    http_status, category = 429, "resource_exhausted"


class InternalServerError(_StatusMixin, tinker.InternalServerError,
                          native.InternalServerError):
    """A server bug or an unexpected status (INTERNAL and the rest)."""

    http_status, category = 500, "internal"


class CancelledError(_StatusMixin, tinker.APIStatusError, native.CancelledError):
    """The call was cancelled before it finished, by this client or because it went away
    (CANCELLED)."""

    http_status, category = 499, "cancelled"


class APIConnectionError(tinker.APIConnectionError, native.UnavailableError):
    """The server is unreachable or shutting down (UNAVAILABLE)."""

    category = "unavailable"

    def __init__(self, message: str, *, method: str = "", target: str = "") -> None:
        tinker.APIConnectionError.__init__(self, _request(target, method), message)
        self.method = method
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.message, self.method, self.target)


class APITimeoutError(tinker.APITimeoutError, native.DeadlineExceededError):
    """The call ran past its deadline (DEADLINE_EXCEEDED)."""

    category = "deadline_exceeded"

    def __init__(self, message: str, *, method: str = "", target: str = "") -> None:
        # Not tinker.APITimeoutError.__init__: it replaces the message with a fixed text.
        tinker.APIConnectionError.__init__(self, _request(target, method), message)
        self.method = method
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.message, self.method, self.target)


CLASSES: dict[str, type[Exception]] = {
    cls.category: cls for cls in (
        BadRequestError, AuthenticationError, PermissionDeniedError, NotFoundError,
        ConflictError, RateLimitError, InternalServerError, CancelledError, APIConnectionError,
        APITimeoutError)
}
"""Category (see `twinkle_client.errors.CATEGORIES`) -> exception class."""


def _rebuild(cls: type, message: str, method: str, target: str) -> Exception:
    return cls(message, method=method, target=target)


def error_factory(target: str) -> ErrorFactory:
    """The `Connection` error factory for a server at gRPC `target` ("host:port").

    Example:
        factory = error_factory("127.0.0.1:8000")
        exc = factory("not_found", "run_id: no run 'x'", "GetRun")
        assert isinstance(exc, tinker.NotFoundError) and str(exc) == "run_id: no run 'x'"
    """

    def make(category: str, message: str, method: str) -> Exception:
        return CLASSES.get(category, InternalServerError)(message, method=method, target=target)

    return make
