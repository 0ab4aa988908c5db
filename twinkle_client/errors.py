"""The client's exception family: one class per gRPC status the server answers with.

`from_rpc_error` is the one mapping from a `grpc.RpcError` to an exception. Each class
carries the server's message (which names the field and the limit), the status code and
the RPC that failed. `tinker_compat` gives the same categories Tinker's exception classes
(see `tinker_compat.errors`), so a status maps to a category in this one place.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc


class TwinkleError(Exception):
    """Base of every error raised by the Twinkle clients."""

    code: grpc.StatusCode | None = None

    def __init__(self, message: str, *args: object, method: str = "") -> None:
        super().__init__(message, *args)
        self.message = message
        self.method = method

    def __str__(self) -> str:
        return self.message


class InvalidArgumentError(TwinkleError):
    """The request was malformed or out of a limit (INVALID_ARGUMENT)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class AuthenticationError(TwinkleError):
    """The API key is missing or invalid (UNAUTHENTICATED)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(TwinkleError):
    """The key may not do this (PERMISSION_DENIED)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFoundError(TwinkleError):
    """No such run, model, session or checkpoint for this tenant (NOT_FOUND)."""

    code = grpc.StatusCode.NOT_FOUND


class ResourceExhaustedError(TwinkleError):
    """No free adapter slot, too many sessions or tokens (RESOURCE_EXHAUSTED)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(TwinkleError):
    """The model is not in a state for this op, e.g. unloaded (FAILED_PRECONDITION)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class UnavailableError(TwinkleError):
    """The server is unreachable or shutting down (UNAVAILABLE)."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(TwinkleError):
    """The call took longer than its deadline (DEADLINE_EXCEEDED)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(TwinkleError):
    """The call was cancelled before it finished (CANCELLED): by this client (its call
    cancelled, its connection closed), or by the server because the caller went away: a
    retried sample whose first attempt was cancelled keeps that answer, as every seq_id
    keeps its first outcome; sample again with a new seq_id."""

    code = grpc.StatusCode.CANCELLED


class InternalServerError(TwinkleError):
    """A server bug or an unexpected status (INTERNAL and the rest)."""

    code = grpc.StatusCode.INTERNAL


CATEGORIES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.OUT_OF_RANGE: "invalid_argument",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "permission_denied",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.ALREADY_EXISTS: "failed_precondition",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "failed_precondition",
    grpc.StatusCode.ABORTED: "failed_precondition",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
}
"""gRPC status -> error category; anything not listed is `internal`."""

NATIVE_CLASSES: dict[str, type[TwinkleError]] = {
    "invalid_argument": InvalidArgumentError,
    "unauthenticated": AuthenticationError,
    "permission_denied": PermissionDeniedError,
    "not_found": NotFoundError,
    "resource_exhausted": ResourceExhaustedError,
    "failed_precondition": FailedPreconditionError,
    "unavailable": UnavailableError,
    "deadline_exceeded": DeadlineExceededError,
    "cancelled": CancelledError,
    "internal": InternalServerError,
}

ErrorFactory = Callable[[str, str, str], Exception]
"""(category, message, method) -> the exception a client raises."""


def require_int(value: object, field: str, minimum: int = 1,
                error: type[Exception] = ValueError) -> int:
    """`value` if it is an int (not a bool) >= `minimum`; else `error` naming the field."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise error(f"{field}: must be an int >= {minimum}, got {value!r}")
    return value


def native_error(category: str, message: str, method: str) -> TwinkleError:
    """The `twinkle_client` exception for a category."""
    return NATIVE_CLASSES[category](message, method=method)


def category_of(code: grpc.StatusCode | None) -> str:
    return CATEGORIES.get(code, "internal") if code is not None else "internal"


def from_rpc_error(error: grpc.RpcError, method: str = "",
                   factory: ErrorFactory = native_error) -> Exception:
    """The exception for a failed call, carrying the server's message."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    message = details or (f"{method}: {code.name}" if code is not None else str(error))
    if code == grpc.StatusCode.UNAVAILABLE and not details:
        message = f"{method}: the server is unreachable"
    return factory(category_of(code), message, method)
