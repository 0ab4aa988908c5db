"""Signed, expiring download URLs: a URL names one path, a time and the tenant it was
signed for, and carries `HMAC-SHA256(secret, path + "\\n" + expires + "\\n" + tenant)`
(no tenant: `path + "\\n" + expires`, the form of URLs signed before URLs named one);
whoever holds it may GET that path, with no API key, until it expires, and no other
path. The tenant is whose read the download is, in the audit log.

The secret is 32 random bytes in `<data dir>/url_signing.key`, created once with mode
0600 (owner read/write only): URLs survive a restart, and anyone who can read the data
dir could read the checkpoints anyway. Deleting the file revokes every URL signed so far
(the next start makes a new one). Signatures are compared with `hmac.compare_digest`, so
the time a comparison takes says nothing about the signature.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

from twinkle_server.engine.errors import EngineError

log = logging.getLogger("twinkle_server")
SECRET_FILE = "url_signing.key"
SECRET_BYTES = 32
"""256 bits: the HMAC-SHA256 key size; guessing it is out of reach."""
SECRET_MODE = 0o600
DEFAULT_URL_TTL_SECONDS = 3600
"""How long a signed URL works: the cookbook's `weights.download` signs new ones 5
minutes before they expire, so a lifetime near that would re-sign before every file."""


class BadSignature(EngineError):
    """A URL whose signature is missing, malformed, wrong for its path, or expired
    (HTTP 403: the URL, not the file, is at fault)."""

    category = "permission_denied"


@dataclass(frozen=True)
class SignedPath:
    path: str        # starts with '/'
    expires: int     # unix seconds
    signature: str   # hex
    reader: str = ""  # the tenant it was signed for ('': none named)

    @property
    def url(self) -> str:
        """The path with its query: put a scheme and host in front to fetch it."""
        query = {"expires": self.expires, "signature": self.signature}
        if self.reader:
            query["reader"] = self.reader
        return f"{self.path}?{urlencode(query)}"


def load_secret(data_dir: str | Path) -> bytes:
    """The data dir's signing secret, made on first use. A file readable by others is
    narrowed back to 0600 (and logged), since its bytes open every signed URL."""
    path = Path(data_dir) / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SECRET_MODE)
    except FileExistsError:
        return _read_secret(path)
    secret = secrets.token_bytes(SECRET_BYTES)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret)
        handle.flush()
        os.fsync(handle.fileno())
    return secret


def _read_secret(path: Path) -> bytes:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("%s had mode %o; set to %o", path, mode, SECRET_MODE)
        os.chmod(path, SECRET_MODE)
    secret = path.read_bytes()
    if len(secret) < SECRET_BYTES:
        raise RuntimeError(f"{path}: {len(secret)} bytes, expected {SECRET_BYTES}; delete it "
                           "to make a new secret (URLs signed so far stop working)")
    return secret


class Signer:
    """Signs and checks (path, expiry) pairs with one secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < SECRET_BYTES:
            raise ValueError(f"secret: {len(secret)} bytes; at least {SECRET_BYTES}")
        self._secret = secret

    def _mac(self, path: str, expires: int, reader: str = "") -> str:
        message = f"{path}\n{expires}" + (f"\n{reader}" if reader else "")
        return hmac.new(self._secret, message.encode(), hashlib.sha256).hexdigest()

    def sign(self, path: str, ttl_seconds: int = DEFAULT_URL_TTL_SECONDS,
             now: float | None = None, reader: str = "") -> SignedPath:
        """`path` (absolute, no query) signed to work for `ttl_seconds` from `now`, for
        the tenant `reader` ('': none named)."""
        if not path.startswith("/") or "?" in path:
            raise ValueError(f"path: {path!r} must start with '/' and carry no query")
        expires = int((time.time() if now is None else now) + ttl_seconds)
        return SignedPath(path, expires, self._mac(path, expires, reader), reader)

    def check(self, path: str, expires: str | None, signature: str | None,
              now: float | None = None, reader: str | None = None) -> None:
        """Raise `BadSignature` unless `signature` signs exactly `path`, `expires` and
        `reader`, and `expires` is still ahead of `now`."""
        try:
            when = int(expires or "")
        except ValueError:
            raise BadSignature("expires: missing or not an integer") from None
        expected = self._mac(path, when, reader or "")
        if not hmac.compare_digest(expected.encode(), (signature or "").encode()):
            raise BadSignature("signature: does not sign this path and expiry")
        if (time.time() if now is None else now) >= when:
            raise BadSignature("expires: the URL has expired; ask for new URLs")
