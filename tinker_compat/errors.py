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

An op the stock SDK runs as a future (create a model, forward, forward_backward,
optim_step, save, load, sample, compute_logprobs) raises there a status error when the
server refuses it at once and `tinker.RequestFailedError` (category `user` or `server`)
when it fails once accepted; over gRPC the two are one status, so such an op's error is
an instance of both (`<Class>RequestFailed`, made by `_failed`): code written with either
`except` catches it, and its `category` is the SDK's `RequestErrorCategory` (4xx `user`,
else `server`).

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
from tinker import types

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


FUTURED_METHODS = frozenset({"CreateModel", "Forward", "ForwardBackward", "OptimStep",
                             "SaveState", "LoadState", "SaveWeightsForSampler", "Sample",
                             "ComputeLogprobs"})
"""The gRPC calls behind the ops the stock SDK runs as futures (`_APIFuture`)."""


def _failed(cls: type[_StatusMixin]) -> type[Exception]:
    """`cls` that is also a `tinker.RequestFailedError`: a futured op's error."""
    name = f"{cls.__name__}RequestFailed"

    def __init__(self: Any, message: str, *, method: str = "", target: str = "") -> None:
        cls.__init__(self, message, method=method, target=target)
        self.request_id = ""
        self.category = (types.RequestErrorCategory.User if cls.http_status < 500
                         else types.RequestErrorCategory.Server)

    # RequestFailedError first: its __init__ is not run (ours sets its fields), and the
    # status chain's cooperative __init__ calls then never reach it.
    made = type(name, (tinker.RequestFailedError, cls), {
        "__init__": __init__, "__reduce__": cls.__reduce__,
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"{cls.__name__} of an op the SDK runs as a future."})
    globals()[name] = made   # so pickle finds it by name
    return made


_FAILED: dict[type, type[Exception]] = {
    cls: _failed(cls) for cls in CLASSES.values() if issubclass(cls, _StatusMixin)}


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
        cls = CLASSES.get(category, InternalServerError)
        if method in FUTURED_METHODS and cls in _FAILED:
            cls = _FAILED[cls]
        return cls(message, method=method, target=target)

    return make
