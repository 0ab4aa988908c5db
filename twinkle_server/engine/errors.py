"""The server's one exception family: the engine's errors and the runtime's.

Each class names a category; each front maps categories to its status codes (the gRPC
front in `twinkle_server.service.errors`), so nothing below the fronts knows a protocol.
Messages name the field and the limit.
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


class Unauthenticated(EngineError):
    """No valid API key came with the request (raised by the runtime, never the engine)."""

    category = "unauthenticated"


class Unavailable(EngineError):
    """The server cannot take the request now (shutting down); retry elsewhere or later."""

    category = "unavailable"


class Cancelled(EngineError):
    """The caller cancelled the request (or went away) before it finished; it was stopped
    and its resources freed."""

    category = "cancelled"


class NamesSeqIds:
    """Mixed into an error whose message names a model's seq_ids, counted from 0 as the
    runtime's queues count them: `template` with a `{name}` field a seq_id. A front whose
    clients count otherwise words it their way (`numbered`; the Tinker SDK counts a
    training client's ops from 1)."""

    def __init__(self, template: str, **seq_ids: int) -> None:
        self.template, self.seq_ids = template, seq_ids
        super().__init__(self.numbered(0))

    def numbered(self, first: int) -> str:
        """The message with every seq_id counted from `first`."""
        return self.template.format(**{k: v + first for k, v in self.seq_ids.items()})


class SeqIdInvalid(NamesSeqIds, InvalidArgument):
    """A seq_id no op may have (below the first)."""


class CancelledOp(NamesSeqIds, Cancelled):
    """An ordered op cancelled before it finished: its seq_id stays taken."""

