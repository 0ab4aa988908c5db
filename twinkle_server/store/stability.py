"""Stability records (`stability_records`): the sampled sequences stable_reinforce trains
on, kept a day after their last use and at most a limit per tenant (the policy is
`twinkle_server/runtime/stability.py`'s; this module stores and finds them)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from twinkle_server.store.database import Database

_MAX_PARAMETERS = 500
"""Ids per `IN (...)` query: under SQLite's bound-parameter limit (999 before 3.32)."""


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


class StabilityTable(Database):
    """The `stability_records` table's queries (a part of `Store`)."""

    def add_stability_records(self, records: list[StabilityRecord], limit: int,
                              ttl_seconds: float, now: float | None = None) -> None:
        """Record sampled sequences (one sample request's), in one transaction: first drop
        every tenant's records unused for `ttl_seconds`, then, past `limit` records of a
        tenant, that tenant's least recently used ones (a record named by a training
        request that comes after is then not found)."""
        now = time.time() if now is None else now
        with self._transaction() as db:
            db.execute("DELETE FROM stability_records WHERE last_used_at <= ?",
                       (now - ttl_seconds,))
            db.executemany(
                "INSERT OR REPLACE INTO stability_records VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(r.sequence_id, r.tenant, r.session_id, _blob(r.prompt, "<i4"),
                  _blob(r.tokens, "<i4"), _blob(r.logprobs, "<f4"), r.created_at,
                  r.last_used_at) for r in records])
            for tenant in {r.tenant for r in records}:
                db.execute(
                    "DELETE FROM stability_records WHERE sequence_id IN (SELECT "
                    "sequence_id FROM stability_records WHERE tenant = ? ORDER BY "
                    "last_used_at DESC, created_at DESC LIMIT -1 OFFSET ?)",
                    (tenant, max(0, limit)))

    def stability_records(self, tenant: str, sequence_ids: list[str], ttl_seconds: float,
                          now: float | None = None) -> dict[str, StabilityRecord]:
        """The tenant's records among `sequence_ids` still within `ttl_seconds` of their
        last use, by id; another tenant's, an expired or an unknown id is left out."""
        now = time.time() if now is None else now
        out: dict[str, StabilityRecord] = {}
        ids = list(dict.fromkeys(sequence_ids))
        for start in range(0, len(ids), _MAX_PARAMETERS):
            part = ids[start:start + _MAX_PARAMETERS]
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
        for start in range(0, len(ids), _MAX_PARAMETERS):
            part = ids[start:start + _MAX_PARAMETERS]
            self._write(f"UPDATE stability_records SET last_used_at = ? WHERE tenant = ? AND "
                        f"sequence_id IN ({', '.join('?' * len(part))})", (now, tenant, *part))

    def count_stability_records(self, tenant: str) -> int:
        return self._query("SELECT COUNT(*) FROM stability_records WHERE tenant = ?",
                           (tenant,))[0][0]


def _blob(array: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(array, dtype).tobytes()
