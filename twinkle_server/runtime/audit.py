"""The audit log: who did what, per tenant, kept in the store (`store/audit.py`).

The runtime records an entry (`record`) for every change to a tenant's state and every
read of its stored weights, on either front, named `<resource>_<action>` as Tinker names
its events:

    session_create, session_close        (reason "expired" when no heartbeat came,
                                          "server stopped", or "server restarted":
                                          one a killed server left open)
    model_create, model_unload           (reason: by its owner, session closed or
                                          expired, server stopped)
    sampler_create, sampler_end          (a sampling session: on a checkpoint, the base,
                                          a live model, a snapshot or inflight target of
                                          one; ended with its session, its model, its
                                          snapshot superseded, or the server stopping)
    checkpoint_save                      (save_state, save_weights_for_sampler,
                                          save_weights_external)
    checkpoint_delete                    (by its owner, or reason "expired": its TTL)
    checkpoint_publish, checkpoint_unpublish, checkpoint_ttl_set, checkpoint_copy
    checkpoint_read                      (purpose "load", "sample", "copy" or
                                          "download": into a model, a sampler, a copy, or
                                          out of the server, over gRPC or a signed URL)

Training ops (forward_backward, optim_step, ...) change a live adapter but are not
entries: they are counted in `/metrics`, and what they produce is recorded when it is
saved. Every entry's details name the tenant that did it (`actor`) and what it was about
(`model_id`, `tinker_path`, ...); one the server did on its own (an expiry) is the
owning tenant's, with a `reason`. A tenant reads its own entries only, one UTC day at a
time, as the SDK's `AdminClient.get_audit_log(event_type, day)` asks; an entry about a
published checkpoint another tenant read is the reader's, not the owner's. Entries are
written on the store's writer thread after the op (`Core.write_later`): the op never
waits for its log line.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.runtime.core import Core
from twinkle_server.store.audit import AuditRow
from twinkle_server.store.checkpoints import CheckpointRow
from twinkle_wire import paths

EVENT_TYPES: dict[str, tuple[str, ...]] = {
    "all": (), "checkpoints": ("checkpoint_",), "models": ("model_",),
    "sessions": ("session_",), "samplers": ("sampler_",),
    # The SDK's other kinds: this server has tenants, not projects, teams or
    # organizations, so these ask for events that never happen here.
    "projects": ("project_",), "teams": ("team_",), "organizations": ("organization_",),
}
"""`event_type` -> the event name prefixes it selects (none: every event)."""
MAX_ENTRIES_PER_DAY = 10_000
"""Most entries one answer carries (a day of a busy tenant's saves fits many times). The
SDK's `AuditLogResponse` has no cursor nor flag to say an answer was cut, so a day of
more is refused, naming how to ask for fewer (`Audit.entries`)."""


def checkpoint_details(row: CheckpointRow) -> dict[str, Any]:
    """What a checkpoint event is about, in the SDK's terms."""
    return {"model_id": row.run_id, "tinker_path": paths.tinker_path(row.run_id, row.checkpoint_id),
            "checkpoint_type": row.kind, "owner": row.tenant}


def record(core: Core, tenant: str, event: str, **details: Any) -> None:
    """Append `event` to `tenant`'s log, with `details` and the tenant as its actor
    (`Core.record`)."""
    core.record(tenant, event, **details)


class Audit:
    def __init__(self, core: Core) -> None:
        self.core = core

    async def entries(self, tenant: str, event_type: str = "all", day: str = ""
                      ) -> list[AuditRow]:
        """The tenant's entries of one UTC day (`day` YYYY-MM-DD; empty: today), oldest
        first, of the kind `event_type` names (`EVENT_TYPES`, or one event's name, e.g.
        `checkpoint_delete`); read behind the entries queued so far, so a caller sees
        what it has just done. More than `MAX_ENTRIES_PER_DAY` is refused, not cut."""
        prefixes = EVENT_TYPES.get(event_type)
        if prefixes is None and any(event_type.startswith(p) and event_type != p
                                    for kinds in EVENT_TYPES.values() for p in kinds):
            prefixes = (event_type,)   # one event: no name is the start of another's
        if prefixes is None:
            raise InvalidArgument(f"event_type: {event_type!r}; one of "
                                  f"{', '.join(sorted(EVENT_TYPES))}, or one event's name "
                                  "(e.g. checkpoint_delete)")
        try:
            date = dt.date.fromisoformat(day) if day else dt.datetime.now(dt.timezone.utc).date()
        except ValueError:
            raise InvalidArgument(f"day: {day!r} is not a date (YYYY-MM-DD)") from None
        start = dt.datetime.combine(date, dt.time(), dt.timezone.utc).timestamp()
        limit = MAX_ENTRIES_PER_DAY
        rows = await self.core.write(self.core.store.audit_entries, tenant, start,
                                     start + 86_400, prefixes, limit + 1)
        if len(rows) > limit:
            raise InvalidArgument(
                f"day, event_type: {date} holds more than {limit} entries of event_type "
                f"{event_type!r}, the most one answer carries; ask for fewer with an "
                "event_type of checkpoints, models, samplers or sessions, or one event's "
                "name (e.g. checkpoint_delete)")
        return rows
