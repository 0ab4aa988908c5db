"""The SQLite registry (`twinkle.db` in the data dir, WAL): API keys, sessions, runs,
checkpoint records and stability records. Checkpoint files live under
`checkpoints/<tenant>/<run_id>/`.

Keys are stored only as SHA-256 hashes; the plain key exists once, when it is created.
Lookups go by hash, and the final comparison is `hmac.compare_digest`, so timing says
nothing about a key. Every query is scoped by tenant: another tenant's run or
checkpoint is simply not found, unless its owner published the checkpoint.

The schema has a version (`PRAGMA user_version`): `_SCHEMA` is version 0, and each entry
of `_MIGRATIONS` moves a database one version on, in its own transaction, so a database
made by an older server opens and is brought up to date, and a new one takes the same
path.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

KEY_PREFIX = "tml-"
"""New keys start with `tml-`, the prefix the stock `tinker` SDK requires of an API key;
keys made before (`tw-...`) stay valid: a key is looked up by its hash."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
    key_hash TEXT PRIMARY KEY, key_id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL,
    created_at REAL NOT NULL, revoked_at REAL);
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL, closed_at REAL, tags TEXT NOT NULL DEFAULT '{}');
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, base_model TEXT NOT NULL,
    lora TEXT NOT NULL, user_metadata TEXT NOT NULL, session_id TEXT,
    created_at REAL NOT NULL, last_request_time REAL NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, tenant TEXT NOT NULL,
    rel_path TEXT NOT NULL, size_bytes INTEGER NOT NULL, has_optimizer INTEGER NOT NULL,
    created_at REAL NOT NULL, user_metadata TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (run_id, kind, name));
CREATE INDEX IF NOT EXISTS runs_by_tenant ON runs (tenant, created_at);
CREATE INDEX IF NOT EXISTS checkpoints_by_tenant ON checkpoints (tenant, created_at);
"""
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    # 1: published checkpoints, checkpoint expiry, the per-tenant session listing.
    ("ALTER TABLE checkpoints ADD COLUMN public INTEGER NOT NULL DEFAULT 0",
     "ALTER TABLE checkpoints ADD COLUMN expires_at REAL",
     "CREATE INDEX checkpoints_by_expiry ON checkpoints (expires_at) "
     "WHERE expires_at IS NOT NULL",
     "CREATE INDEX sessions_by_tenant ON sessions (tenant, created_at)"),
    # stability records (`StabilityRecord`): sampled sequences stable_reinforce trains on.
    ("CREATE TABLE stability_records (sequence_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, "
     "session_id TEXT NOT NULL, prompt BLOB NOT NULL, tokens BLOB NOT NULL, "
     "logprobs BLOB NOT NULL, created_at REAL NOT NULL, last_used_at REAL NOT NULL)",
     "CREATE INDEX stability_by_tenant ON stability_records (tenant, last_used_at)",
     "CREATE INDEX stability_by_use ON stability_records (last_used_at)"),
    # the audit log (`AuditRow`): who did what, per tenant.
    ("CREATE TABLE audit_log (entry_id INTEGER PRIMARY KEY AUTOINCREMENT, tenant TEXT NOT "
     "NULL, at REAL NOT NULL, event TEXT NOT NULL, details TEXT NOT NULL)",
     "CREATE INDEX audit_by_tenant ON audit_log (tenant, at)"),
)
SCHEMA_VERSION = len(_MIGRATIONS)
_CHECKPOINT_COLUMNS = ("run_id, kind, name, tenant, rel_path, size_bytes, has_optimizer, "
                       "created_at, user_metadata, public, expires_at")
_SESSION_COLUMNS = "session_id, tenant, created_at, last_heartbeat, closed_at, tags"
SEGMENTS = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
"""A checkpoint kind's path segment: `<run_id>/<segment>/<name>`, on disk and in paths."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyRow:
    key_id: str
    tenant: str
    created_at: float
    revoked_at: float | None


@dataclass(frozen=True)
class SessionRow:
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat: float
    closed_at: float | None
    tags: dict[str, str]


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


@dataclass(frozen=True)
class StabilityRecord:
    """One sampled sequence recorded for stable_reinforce (`record_stability_info`): the
    request's prompt and the sampled tokens (int32) with the sampler's logprob of each
    (float32), owned by the tenant and session that sampled it. It can be trained on
    until a day after `last_used_at` (each training use restarts the day)."""

    sequence_id: str
    tenant: str
    session_id: str
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    created_at: float
    last_used_at: float


@dataclass(frozen=True)
class AuditRow:
    """One audit log entry: `event` (`<resource>_<action>`, e.g. `checkpoint_save`) done
    by or for `tenant` at unix time `at`; `details` names what it was about."""

    tenant: str
    at: float
    event: str
    details: dict[str, Any]


class Store:
    """Thread-safe access to the registry: one connection for writes, one for reads.

    Each has its own lock, so under WAL a read never waits for a write's fsync: the
    runtime writes from a thread of its own and reads (key lookups on every request)
    from the event loop.
    """

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_root = self.data_dir / "checkpoints"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.data_dir / "twinkle.db", check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._migrate()
        self._read_lock = threading.Lock()
        self._reader = sqlite3.connect(self.data_dir / "twinkle.db", check_same_thread=False,
                                       isolation_level=None)

    def _migrate(self) -> None:
        """Bring the database to `SCHEMA_VERSION`, one version per transaction. `BEGIN
        IMMEDIATE` and the version read inside it keep two processes opening one old
        database (the server and `twinkle-server keys`) from both migrating it."""
        for version, statements in enumerate(_MIGRATIONS, start=1):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                current = self._db.execute("PRAGMA user_version").fetchone()[0]
                if current < version:
                    for statement in statements:
                        self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version = {version}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        current = self._db.execute("PRAGMA user_version").fetchone()[0]
        if current > SCHEMA_VERSION:
            self._db.close()
            raise RuntimeError(f"{self.data_dir / 'twinkle.db'}: schema version {current} is "
                               f"newer than this server's {SCHEMA_VERSION}; run a newer server")

    def close(self) -> None:
        with self._read_lock:
            self._reader.close()
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()

    def _query(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._read_lock:
            return self._reader.execute(sql, args).fetchall()

    def _write(self, sql: str, args: tuple = ()) -> int:
        """Run one write statement; returns the number of rows it changed."""
        with self._lock:
            return self._db.execute(sql, args).rowcount

    # ------------------------------------------------------------------ keys

    def create_key(self, tenant: str) -> tuple[str, str]:
        """A new key for `tenant`: returns (key_id, plain key); only the hash is stored."""
        if not tenant or len(tenant) > 64 or not tenant.replace("-", "").replace("_", "").isalnum():
            raise ValueError("tenant: use 1-64 letters, digits, '-' or '_'")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        key_id = secrets.token_hex(4)
        self._write("INSERT INTO api_keys VALUES (?, ?, ?, ?, NULL)",
                    (hash_key(key), key_id, tenant, time.time()))
        return key_id, key

    def list_keys(self) -> list[KeyRow]:
        rows = self._query("SELECT key_id, tenant, created_at, revoked_at FROM api_keys "
                           "ORDER BY created_at")
        return [KeyRow(*r) for r in rows]

    def revoke_key(self, key_id: str) -> bool:
        return self._write("UPDATE api_keys SET revoked_at = ? WHERE key_id = ? "
                           "AND revoked_at IS NULL", (time.time(), key_id)) > 0

    def has_keys(self) -> bool:
        return bool(self._query("SELECT 1 FROM api_keys LIMIT 1"))

    def active_key(self, key: str) -> KeyRow | None:
        """The record of an active key, or None."""
        digest = hash_key(key)
        rows = self._query("SELECT key_hash, key_id, tenant, created_at, revoked_at FROM "
                           "api_keys WHERE key_hash = ? AND revoked_at IS NULL", (digest,))
        for stored, *row in rows:
            if hmac.compare_digest(stored, digest):
                return KeyRow(*row)
        return None

    # ------------------------------------------------------------------ sessions

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

    def open_sessions(self, tenant: str) -> int:
        return self._query("SELECT COUNT(*) FROM sessions WHERE tenant = ? AND closed_at IS "
                           "NULL", (tenant,))[0][0]

    def expired_sessions(self, timeout_s: float) -> list[str]:
        rows = self._query("SELECT session_id FROM sessions WHERE closed_at IS NULL AND "
                           "last_heartbeat < ?", (time.time() - timeout_s,))
        return [r[0] for r in rows]

    # ------------------------------------------------------------------ runs

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

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_dir(self, tenant: str, run_id: str, kind: str, name: str) -> Path:
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


    # ------------------------------------------------------------------ stability records

    def add_stability_records(self, records: list[StabilityRecord], limit: int,
                              ttl_seconds: float, now: float | None = None) -> None:
        """Record sampled sequences (one sample request's), in one transaction: first drop
        every tenant's records unused for `ttl_seconds`, then, past `limit` records of a
        tenant, that tenant's least recently used ones (a record named by a training
        request that comes after is then not found)."""
        now = time.time() if now is None else now
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("DELETE FROM stability_records WHERE last_used_at <= ?",
                                 (now - ttl_seconds,))
                self._db.executemany(
                    "INSERT OR REPLACE INTO stability_records VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(r.sequence_id, r.tenant, r.session_id, _blob(r.prompt, "<i4"),
                      _blob(r.tokens, "<i4"), _blob(r.logprobs, "<f4"), r.created_at,
                      r.last_used_at) for r in records])
                for tenant in {r.tenant for r in records}:
                    self._db.execute(
                        "DELETE FROM stability_records WHERE sequence_id IN (SELECT "
                        "sequence_id FROM stability_records WHERE tenant = ? ORDER BY "
                        "last_used_at DESC, created_at DESC LIMIT -1 OFFSET ?)",
                        (tenant, max(0, limit)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def stability_records(self, tenant: str, sequence_ids: list[str], ttl_seconds: float,
                          now: float | None = None) -> dict[str, StabilityRecord]:
        """The tenant's records among `sequence_ids` still within `ttl_seconds` of their
        last use, by id; another tenant's, an expired or an unknown id is left out."""
        now = time.time() if now is None else now
        out: dict[str, StabilityRecord] = {}
        ids = list(dict.fromkeys(sequence_ids))
        for start in range(0, len(ids), 500):   # SQLite's bound-parameter limit
            part = ids[start:start + 500]
            rows = self._query(
                "SELECT sequence_id, tenant, session_id, prompt, tokens, logprobs, "
                "created_at, last_used_at FROM stability_records WHERE tenant = ? AND "
                f"last_used_at > ? AND sequence_id IN ({', '.join('?' * len(part))})",
                (tenant, now - ttl_seconds, *part))
            for r in rows:
                out[r[0]] = StabilityRecord(
                    r[0], r[1], r[2], np.frombuffer(r[3], "<i4").astype(np.int32),
                    np.frombuffer(r[4], "<i4").astype(np.int32),
                    np.frombuffer(r[5], "<f4").astype(np.float32), r[6], r[7])
        return out

    def touch_stability_records(self, tenant: str, sequence_ids: list[str],
                                now: float | None = None) -> None:
        """A training use: restart the records' day."""
        now = time.time() if now is None else now
        ids = list(dict.fromkeys(sequence_ids))
        for start in range(0, len(ids), 500):
            part = ids[start:start + 500]
            self._write(f"UPDATE stability_records SET last_used_at = ? WHERE tenant = ? AND "
                        f"sequence_id IN ({', '.join('?' * len(part))})", (now, tenant, *part))

    # ------------------------------------------------------------------ audit log

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
        return [AuditRow(r[0], r[1], r[2], json.loads(r[3])) for r in rows]

    def find_audit(self, tenant: str, event: str, key: str, value: str) -> AuditRow | None:
        """The tenant's latest `event` entry whose details have `key` = `value` (a
        retried copy_weights finds its first answer by its idempotency key)."""
        rows = self._query("SELECT tenant, at, event, details FROM audit_log WHERE tenant = ? "
                           "AND event = ? AND json_extract(details, ?) = ? "
                           "ORDER BY entry_id DESC LIMIT 1", (tenant, event, f"$.{key}", value))
        return AuditRow(rows[0][0], rows[0][1], rows[0][2], json.loads(rows[0][3])) if rows else None

    def count_stability_records(self, tenant: str) -> int:
        return self._query("SELECT COUNT(*) FROM stability_records WHERE tenant = ?",
                           (tenant,))[0][0]


def _blob(array: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(array, dtype).tobytes()


def _run(r: tuple) -> RunRow:
    return RunRow(r[0], r[1], r[2], json.loads(r[3]), json.loads(r[4]), r[5], r[6], r[7])


def _session(r: tuple) -> SessionRow:
    return SessionRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]))


def _checkpoint(r: tuple) -> CheckpointRow:
    return CheckpointRow(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), r[7], json.loads(r[8]),
                         bool(r[9]), r[10])
