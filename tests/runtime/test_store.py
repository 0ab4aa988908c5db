"""The registry's schema versions: a database made by the previous server (schema 0, no
version) opens, is migrated in place and keeps its keys, sessions, runs and checkpoints;
a database from a newer server is refused rather than misread."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from twinkle_server.store import SCHEMA_VERSION, Store, hash_key

OLD_SCHEMA = """
CREATE TABLE api_keys (
    key_hash TEXT PRIMARY KEY, key_id TEXT UNIQUE NOT NULL, tenant TEXT NOT NULL,
    created_at REAL NOT NULL, revoked_at REAL);
CREATE TABLE sessions (
    session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL, closed_at REAL, tags TEXT NOT NULL DEFAULT '{}');
CREATE TABLE runs (
    run_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, base_model TEXT NOT NULL,
    lora TEXT NOT NULL, user_metadata TEXT NOT NULL, session_id TEXT,
    created_at REAL NOT NULL, last_request_time REAL NOT NULL);
CREATE TABLE checkpoints (
    run_id TEXT NOT NULL, kind TEXT NOT NULL, name TEXT NOT NULL, tenant TEXT NOT NULL,
    rel_path TEXT NOT NULL, size_bytes INTEGER NOT NULL, has_optimizer INTEGER NOT NULL,
    created_at REAL NOT NULL, user_metadata TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (run_id, kind, name));
CREATE INDEX runs_by_tenant ON runs (tenant, created_at);
CREATE INDEX checkpoints_by_tenant ON checkpoints (tenant, created_at);
"""
"""The schema as the server before versioning (git 2754f69) created it."""


def _old_database(data_dir) -> None:
    now = time.time()
    with sqlite3.connect(data_dir / "twinkle.db") as db:
        db.executescript(OLD_SCHEMA)
        db.execute("INSERT INTO api_keys VALUES (?, 'k1', 'alice', ?, NULL)",
                   (hash_key("tml-old-key"), now))
        db.execute("INSERT INTO sessions VALUES ('sess-old', 'alice', ?, ?, NULL, '{}')",
                   (now, now))
        db.execute("INSERT INTO runs VALUES ('run-old', 'alice', 'tiny', ?, '{}', 'sess-old', "
                   "?, ?)", (json.dumps({"rank": 4}), now, now))
        db.execute("INSERT INTO checkpoints VALUES ('run-old', 'training', 'step-1', 'alice', "
                   "'alice/run-old/weights/step-1', 123, 1, ?, '{\"a\": \"b\"}')", (now,))
    db.close()


def test_a_database_of_the_previous_schema_opens_migrated_with_its_records(tmp_path):
    _old_database(tmp_path)
    store = Store(tmp_path)
    try:
        assert store.active_key("tml-old-key").tenant == "alice"
        assert [s.session_id for s in store.list_sessions("alice", 10, 0)[0]] == ["sess-old"]
        assert store.session_runs("alice", "sess-old") == ["run-old"]
        rows, total = store.list_checkpoints("alice", "run-old")
        assert total == 1
        row = rows[0]
        assert (row.name, row.size_bytes, row.has_optimizer, row.user_metadata) == (
            "step-1", 123, True, {"a": "b"})
        assert row.public is False and row.expires_at is None
        # The new columns work on the migrated rows.
        assert store.get_checkpoint("bob", "run-old", "training", "step-1",
                                    include_public=True) is None
        store.set_checkpoint_public(row, True)
        store.set_checkpoint_expiry(row, 5.0)
        seen = store.get_checkpoint("bob", "run-old", "training", "step-1", include_public=True)
        assert seen.public and seen.expires_at == 5.0
        assert store.expired_checkpoints(now=6.0) == [seen]
    finally:
        store.close()
    # Opening again changes nothing.
    store = Store(tmp_path)
    try:
        assert store.list_checkpoints("alice", None)[0][0].public is True
    finally:
        store.close()
    with sqlite3.connect(tmp_path / "twinkle.db") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.close()


def test_a_new_database_has_the_same_schema_as_a_migrated_one(tmp_path):
    (tmp_path / "old").mkdir()
    _old_database(tmp_path / "old")
    Store(tmp_path / "old").close()
    Store(tmp_path / "new").close()

    def schema(path) -> list[tuple]:
        with sqlite3.connect(path / "twinkle.db") as db:
            columns = [(t, *c[1:]) for t in ("api_keys", "sessions", "runs", "checkpoints")
                       for c in db.execute(f"PRAGMA table_info({t})")]
            indexes = sorted(r[0] for r in db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"))
        db.close()
        return [*columns, *indexes]
    assert schema(tmp_path / "old") == schema(tmp_path / "new")


def test_a_database_from_a_newer_server_is_refused(tmp_path):
    Store(tmp_path).close()
    with sqlite3.connect(tmp_path / "twinkle.db") as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(RuntimeError, match="newer than this server"):
        Store(tmp_path)


def test_no_checkpoint_dir_is_given_for_a_tenant_that_is_no_name(tmp_path):
    """A tenant names a directory: '..' would put a checkpoint outside the data dir."""
    store = Store(tmp_path / "data")
    try:
        for tenant in ("../../escaped", "a/b", "", "x" * 65):
            with pytest.raises(ValueError, match="use 1-64 letters, digits, '-' or '_'"):
                store.checkpoint_dir(tenant, "run-1", "external", "imported")
        assert store.checkpoint_dir("alice_2-b", "run-1", "external", "imported") == (
            tmp_path / "data" / "checkpoints" / "alice_2-b" / "run-1" / "external_weights"
            / "imported")
    finally:
        store.close()
