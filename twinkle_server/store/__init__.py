"""The SQLite registry (`twinkle.db` in the data dir, WAL): API keys, sessions, runs,
checkpoint records, stability records and the audit log. Checkpoint files live under
`checkpoints/<tenant>/<run_id>/`.

One module per table, each a class of queries; `Store` is all of them over one file:

    database.py     the file: schema and its versions, one writer and one reader
                    connection, each behind its lock (`Database`)
    keys.py         api_keys: stored as SHA-256 hashes, compared in constant time
    sessions.py     sessions: tags, heartbeats, closing
    runs.py         runs: a tenant's models
    checkpoints.py  checkpoints: saved weights, publishing, expiry
    stability.py    stability_records: sampled sequences stable_reinforce trains on
    audit.py        audit_log: who did what
    lock.py         `.lock`: the one live server that owns the data dir, and
                    `.keys.lock`: its open-or-keyed decision apart from `keys create`
                    (files, not tables)

Every query is scoped by tenant: another tenant's run or checkpoint is simply not found,
unless its owner published the checkpoint.
"""

from __future__ import annotations

from twinkle_server.store.audit import AuditRow, AuditTable
from twinkle_server.store.checkpoints import SEGMENTS, CheckpointRow, CheckpointTable
from twinkle_server.store.database import SCHEMA_VERSION
from twinkle_server.store.keys import KEY_PREFIX, KeyRow, KeyTable, hash_key
from twinkle_server.store.runs import RunRow, RunTable
from twinkle_server.store.sessions import SessionRow, SessionTable
from twinkle_server.store.stability import StabilityRecord, StabilityTable

__all__ = ["KEY_PREFIX", "SCHEMA_VERSION", "SEGMENTS", "AuditRow", "CheckpointRow", "KeyRow",
           "RunRow", "SessionRow", "StabilityRecord", "Store", "hash_key"]


class Store(KeyTable, SessionTable, RunTable, CheckpointTable, StabilityTable, AuditTable):
    """Thread-safe access to the registry (`Database`), with every table's queries.

    Writes go through one connection and reads through another, each behind its own lock,
    so under WAL a read never waits for a write's fsync.
    """
