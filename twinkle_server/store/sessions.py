"""Client sessions (`sessions`): who opened one, its tags, its last heartbeat, and
whether it is closed."""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from twinkle_server.store.database import Database

_SESSION_COLUMNS = "session_id, tenant, created_at, last_heartbeat, closed_at, tags"


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat: float
    closed_at: float | None
    tags: dict[str, str]


class SessionTable(Database):
    """The `sessions` table's queries (a part of `Store`)."""

    def create_session(self, tenant: str, tags: dict[str, str]) -> str:
        session_id = "sess-" + secrets.token_hex(8)
        now = time.time()
        self._write("INSERT INTO sessions VALUES (?, ?, ?, ?, NULL, ?)",
                    (session_id, tenant, now, now, json.dumps(tags)))
        return session_id

    def get_session(self, tenant: str, session_id: str) -> SessionRow | None:
        """A tenant's session, open or closed."""
        rows = self._query(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE session_id = ? "
                           "AND tenant = ?", (session_id, tenant))
        return _session(rows[0]) if rows else None

    def list_sessions(self, tenant: str, limit: int, offset: int
                      ) -> tuple[list[SessionRow], int]:
        """Every session the tenant created, open or closed, newest first."""
        total = self._query("SELECT COUNT(*) FROM sessions WHERE tenant = ?", (tenant,))[0][0]
        rows = self._query(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE tenant = ? "
                           "ORDER BY created_at DESC, session_id LIMIT ? OFFSET ?",
                           (tenant, limit, offset))
        return [_session(r) for r in rows], total

    def session_tenant(self, session_id: str) -> str | None:
        rows = self._query("SELECT tenant FROM sessions WHERE session_id = ? "
                           "AND closed_at IS NULL", (session_id,))
        return rows[0][0] if rows else None

    def heartbeat(self, session_id: str) -> None:
        self._write("UPDATE sessions SET last_heartbeat = ? WHERE session_id = ?",
                    (time.time(), session_id))

    def close_session(self, session_id: str) -> None:
        self._write("UPDATE sessions SET closed_at = ? WHERE session_id = ?",
                    (time.time(), session_id))

    def close_open_sessions(self) -> list[tuple[str, str]]:
        """Close every open session, of every tenant: each closed (session_id, tenant)."""
        rows = self._query("SELECT session_id, tenant FROM sessions WHERE closed_at IS NULL "
                           "ORDER BY created_at, session_id")
        self._write("UPDATE sessions SET closed_at = ? WHERE closed_at IS NULL", (time.time(),))
        return [(r[0], r[1]) for r in rows]

    def open_sessions(self, tenant: str) -> int:
        return self._query("SELECT COUNT(*) FROM sessions WHERE tenant = ? AND closed_at IS "
                           "NULL", (tenant,))[0][0]

    def expired_sessions(self, timeout_s: float) -> list[str]:
        rows = self._query("SELECT session_id FROM sessions WHERE closed_at IS NULL AND "
                           "last_heartbeat < ?", (time.time() - timeout_s,))
        return [r[0] for r in rows]


def _session(r: tuple) -> SessionRow:
    return SessionRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]))
