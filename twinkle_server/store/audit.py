"""The audit log (`audit_log`): who did what, per tenant (what is recorded, and when, is
`twinkle_server/runtime/audit.py`'s; this module stores and finds the entries)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from twinkle_server.store.database import Database


@dataclass(frozen=True)
class AuditRow:
    """One audit log entry: `event` (`<resource>_<action>`, e.g. `checkpoint_save`) done
    by or for `tenant` at unix time `at`; `details` names what it was about."""

    tenant: str
    at: float
    event: str
    details: dict[str, Any]


class AuditTable(Database):
    """The `audit_log` table's queries (a part of `Store`)."""

    def add_audit(self, row: AuditRow) -> None:
        self._write("INSERT INTO audit_log (tenant, at, event, details) VALUES (?, ?, ?, ?)",
                    (row.tenant, row.at, row.event, json.dumps(row.details, sort_keys=True)))

    def audit_entries(self, tenant: str, start: float, end: float,
                      event_prefixes: tuple[str, ...] = (), limit: int = 10_000
                      ) -> list[AuditRow]:
        """The tenant's entries with `start <= at < end`, oldest first; with
        `event_prefixes`, only events starting with one of them. Never another tenant's."""
        where, args = "", tuple(event_prefixes)
        if event_prefixes:
            where = " AND (" + " OR ".join("instr(event, ?) = 1" for _ in args) + ")"
        rows = self._query("SELECT tenant, at, event, details FROM audit_log WHERE tenant = ? "
                           f"AND at >= ? AND at < ?{where} ORDER BY at, entry_id LIMIT ?",
                           (tenant, start, end, *args, limit))
        return [_audit(r) for r in rows]

    def find_audit(self, tenant: str, event: str, key: str, value: str) -> AuditRow | None:
        """The tenant's latest `event` entry whose details have `key` = `value` (a
        retried copy_weights finds its first answer by its idempotency key)."""
        rows = self._query("SELECT tenant, at, event, details FROM audit_log WHERE tenant = ? "
                           "AND event = ? AND json_extract(details, ?) = ? "
                           "ORDER BY entry_id DESC LIMIT 1", (tenant, event, f"$.{key}", value))
        return _audit(rows[0]) if rows else None


def _audit(r: tuple) -> AuditRow:
    return AuditRow(r[0], r[1], r[2], json.loads(r[3]))
