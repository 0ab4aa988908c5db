"""API keys (`api_keys`): stored only as SHA-256 hashes; the plain key exists once, when
it is created. Lookups go by hash, and the final comparison is `hmac.compare_digest`, so
timing says nothing about a key."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from twinkle_server.store.database import Database

KEY_PREFIX = "tml-"
"""New keys start with `tml-`, the prefix the stock `tinker` SDK requires of an API key;
keys made before (`tw-...`) stay valid: a key is looked up by its hash."""


def check_tenant(tenant: str) -> None:
    """Raise ValueError unless `tenant` is 1-64 letters, digits, '-' or '_': a tenant
    names a directory (`checkpoints/<tenant>/`), so '..' or '/' would leave the data dir."""
    if not tenant or len(tenant) > 64 or not tenant.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"tenant {tenant!r}: use 1-64 letters, digits, '-' or '_'")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyRow:
    key_id: str
    tenant: str
    created_at: float
    revoked_at: float | None


class KeyTable(Database):
    """The `api_keys` table's queries (a part of `Store`)."""

    def create_key(self, tenant: str) -> tuple[str, str]:
        """A new key for `tenant`: returns (key_id, plain key); only the hash is stored."""
        check_tenant(tenant)
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
