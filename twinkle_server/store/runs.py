"""Training runs (`runs`): one per model a tenant created, with its base model, LoRA
config, metadata and the session that made it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from twinkle_server.store.database import Database


@dataclass(frozen=True)
class RunRow:
    run_id: str
    tenant: str
    base_model: str
    lora: dict[str, Any]
    user_metadata: dict[str, str]
    session_id: str | None
    created_at: float
    last_request_time: float


class RunTable(Database):
    """The `runs` table's queries (a part of `Store`)."""

    def create_run(self, run_id: str, tenant: str, base_model: str, lora: dict[str, Any],
                   user_metadata: dict[str, str], session_id: str | None) -> RunRow:
        now = time.time()
        self._write("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (run_id, tenant, base_model, json.dumps(lora), json.dumps(user_metadata),
                     session_id, now, now))
        return self.get_run(tenant, run_id)  # type: ignore[return-value]

    def session_runs(self, tenant: str, session_id: str) -> list[str]:
        """The ids of the tenant's runs made in a session, oldest first."""
        rows = self._query("SELECT run_id FROM runs WHERE tenant = ? AND session_id = ? "
                           "ORDER BY created_at, run_id", (tenant, session_id))
        return [r[0] for r in rows]

    def touch_run(self, run_id: str) -> None:
        self._write("UPDATE runs SET last_request_time = ? WHERE run_id = ?",
                    (time.time(), run_id))

    def get_run(self, tenant: str, run_id: str) -> RunRow | None:
        rows = self._query("SELECT * FROM runs WHERE run_id = ? AND tenant = ?",
                           (run_id, tenant))
        return _run(rows[0]) if rows else None

    def list_runs(self, tenant: str | None, limit: int, offset: int) -> tuple[list[RunRow], int]:
        where, args = ("WHERE tenant = ?", (tenant,)) if tenant else ("", ())
        total = self._query(f"SELECT COUNT(*) FROM runs {where}", args)[0][0]
        rows = self._query(f"SELECT * FROM runs {where} ORDER BY created_at DESC, run_id "
                           "LIMIT ? OFFSET ?", (*args, limit, offset))
        return [_run(r) for r in rows], total


def _run(r: tuple) -> RunRow:
    return RunRow(r[0], r[1], r[2], json.loads(r[3]), json.loads(r[4]), r[5], r[6], r[7])
