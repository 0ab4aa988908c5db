"""Checkpoint records (`checkpoints`): a run's saved weights, by kind and name, with
their place under `checkpoints/<tenant>/<run_id>/` in the data dir, whether they are
published, and when they expire."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from twinkle_server.store.database import Database
from twinkle_server.store.keys import check_tenant

_CHECKPOINT_COLUMNS = ("run_id, kind, name, tenant, rel_path, size_bytes, has_optimizer, "
                       "created_at, user_metadata, public, expires_at")
SEGMENTS = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
"""A checkpoint kind's path segment: `<run_id>/<segment>/<name>`, on disk and in paths."""


@dataclass(frozen=True)
class CheckpointRow:
    run_id: str
    kind: str            # "training", "sampler" or "external" (`SEGMENTS`)
    name: str
    tenant: str
    rel_path: str
    size_bytes: int
    has_optimizer: bool
    created_at: float
    user_metadata: dict[str, str]
    public: bool = False                # readable by every tenant; only the owner changes it
    expires_at: float | None = None     # unix time the expiry sweep deletes it; None: never

    @property
    def segment(self) -> str:
        return SEGMENTS[self.kind]

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"


class CheckpointTable(Database):
    """The `checkpoints` table's queries (a part of `Store`)."""

    def checkpoint_dir(self, tenant: str, run_id: str, kind: str, name: str) -> Path:
        """Where a checkpoint's files go; ValueError for a tenant that is no name."""
        check_tenant(tenant)
        segment = SEGMENTS[kind]
        return self.checkpoint_root / tenant / run_id / segment / name

    def add_checkpoint(self, row: CheckpointRow) -> None:
        """Record a checkpoint; a save over an existing name replaces its record, so the
        new weights start private and with no expiry, whatever the old ones had."""
        self._write(f"INSERT OR REPLACE INTO checkpoints ({_CHECKPOINT_COLUMNS}) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (row.run_id, row.kind, row.name, row.tenant, row.rel_path, row.size_bytes,
                     int(row.has_optimizer), row.created_at, json.dumps(row.user_metadata),
                     int(row.public), row.expires_at))

    def get_checkpoint(self, tenant: str, run_id: str, kind: str, name: str, *,
                       include_public: bool = False) -> CheckpointRow | None:
        """The tenant's checkpoint, or (`include_public`) any tenant's published one."""
        owner = "(tenant = ? OR public = 1)" if include_public else "tenant = ?"
        rows = self._query(f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints WHERE run_id = ? "
                           f"AND kind = ? AND name = ? AND {owner}", (run_id, kind, name, tenant))
        return _checkpoint(rows[0]) if rows else None

    def find_checkpoint(self, run_id: str, kind: str, name: str) -> CheckpointRow | None:
        """Any tenant's checkpoint by its key: only for a request whose right to it was
        checked some other way (a signed download URL, `runtime.external`)."""
        rows = self._query(f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints WHERE run_id = ? "
                           "AND kind = ? AND name = ?", (run_id, kind, name))
        return _checkpoint(rows[0]) if rows else None

    def set_checkpoint_public(self, row: CheckpointRow, public: bool) -> None:
        self._write("UPDATE checkpoints SET public = ? WHERE run_id = ? AND kind = ? AND "
                    "name = ?", (int(public), row.run_id, row.kind, row.name))

    def set_checkpoint_expiry(self, row: CheckpointRow, expires_at: float | None) -> None:
        self._write("UPDATE checkpoints SET expires_at = ? WHERE run_id = ? AND kind = ? AND "
                    "name = ?", (expires_at, row.run_id, row.kind, row.name))

    def expired_checkpoints(self, now: float) -> list[CheckpointRow]:
        """Every tenant's checkpoints whose expiry is at or before `now`."""
        rows = self._query(f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints WHERE expires_at "
                           "IS NOT NULL AND expires_at <= ?", (now,))
        return [_checkpoint(r) for r in rows]

    def list_checkpoints(self, tenant: str | None, run_id: str | None, limit: int = 1000,
                         offset: int = 0) -> tuple[list[CheckpointRow], int]:
        clauses, args = [], []
        if tenant:
            clauses.append("tenant = ?")
            args.append(tenant)
        if run_id:
            clauses.append("run_id = ?")
            args.append(run_id)
        where = ("WHERE " + " AND ".join(clauses)) if clauses else ""
        total = self._query(f"SELECT COUNT(*) FROM checkpoints {where}", tuple(args))[0][0]
        rows = self._query(f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints {where} "
                           "ORDER BY created_at DESC, name LIMIT ? OFFSET ?",
                           (*args, limit, offset))
        return [_checkpoint(r) for r in rows], total

    def delete_checkpoint(self, row: CheckpointRow, expired_by: float | None = None) -> bool:
        """Delete a checkpoint's record (with `expired_by`: only if it expires by then);
        returns whether there was one to delete."""
        sql, args = ("DELETE FROM checkpoints WHERE run_id = ? AND kind = ? AND name = ?",
                     (row.run_id, row.kind, row.name))
        if expired_by is not None:
            sql, args = sql + " AND expires_at <= ?", (*args, expired_by)
        return self._write(sql, args) > 0


def _checkpoint(r: tuple) -> CheckpointRow:
    return CheckpointRow(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), r[7], json.loads(r[8]),
                         bool(r[9]), r[10])
