"""The registry's SQLite file (`twinkle.db` in the data dir, WAL): its schema, its
migrations, and the one connection discipline every table's queries go through.

The schema has a version (`PRAGMA user_version`): `_SCHEMA` is version 0, and each entry
of `_MIGRATIONS` moves a database one version on, in its own transaction, so a database
made by an older server opens and is brought up to date, and a new one takes the same
path. The schema of every table is here, in version order, rather than beside each
table's queries: a version is a step of the whole file.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
DB_FILE = "twinkle.db"


class Database:
    """Thread-safe access to the registry: one connection for writes, one for reads.

    Each has its own lock, so under WAL a read never waits for a write's fsync: the
    runtime writes from a thread of its own and reads (key lookups on every request)
    from the event loop. Every table's queries (`store/keys.py`, ...) are methods of a
    subclass and reach the file only through `_query`, `_write` and `_transaction`.
    """

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_root = self.data_dir / "checkpoints"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.data_dir / DB_FILE, check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._migrate()
        self._read_lock = threading.Lock()
        self._reader = sqlite3.connect(self.data_dir / DB_FILE, check_same_thread=False,
                                       isolation_level=None)

    def _migrate(self) -> None:
        """Bring the database to `SCHEMA_VERSION`, one version per transaction. `BEGIN
        IMMEDIATE` and the version read inside it keep two processes opening one old
        database (the server and `twinkle-server keys`) from both migrating it."""
        for version, statements in enumerate(_MIGRATIONS, start=1):
            with self._transaction() as db:
                if db.execute("PRAGMA user_version").fetchone()[0] < version:
                    for statement in statements:
                        db.execute(statement)
                    db.execute(f"PRAGMA user_version = {version}")
        current = self._db.execute("PRAGMA user_version").fetchone()[0]
        if current > SCHEMA_VERSION:
            self._db.close()
            raise RuntimeError(f"{self.data_dir / DB_FILE}: schema version {current} is "
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

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """The writer connection inside one `BEGIN IMMEDIATE` transaction, under the
        write lock: committed when the block ends, rolled back if it raises."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
