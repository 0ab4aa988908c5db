"""The engine's one exception family.

Each class names a category; `twinkle_server.service.errors` maps categories to gRPC
status codes, so the engine never imports gRPC. Messages name the field and the limit.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""

    category = "internal"


class InvalidArgument(EngineError):
    """The request itself is wrong (shape, range, unknown name); retrying will not help."""

    category = "invalid_argument"


class NotFound(EngineError):
    """No such adapter, checkpoint or run (also what another tenant's objects look like)."""

    category = "not_found"


class ResourceExhausted(EngineError):
    """A capacity limit: adapter slots, memory, tokens per batch."""

    category = "resource_exhausted"


class FailedPrecondition(EngineError):
    """The request is valid but the state does not allow it now (e.g. no optimizer set)."""

    category = "failed_precondition"
