"""Signed download URLs (`runtime.signed_urls`): a signature opens exactly its path until
its expiry; the secret is made once per data dir, owner-only."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

import pytest

from twinkle_server.runtime.signed_urls import (
    SECRET_BYTES,
    SECRET_FILE,
    BadSignature,
    Signer,
    load_secret,
)

NOW = 1_800_000_000.0
PATH = "/api/v1/external_weights/run-1/final/adapter_model.safetensors"


@pytest.fixture
def signer() -> Signer:
    return Signer(b"k" * SECRET_BYTES)


def test_a_signature_is_hmac_sha256_of_path_and_expiry(signer):
    signed = signer.sign(PATH, 600, now=NOW)
    assert signed.expires == int(NOW) + 600
    expected = hmac.new(b"k" * SECRET_BYTES, f"{PATH}\n{int(NOW) + 600}".encode(),
                        hashlib.sha256).hexdigest()
    assert signed.signature == expected
    assert signed.url == f"{PATH}?expires={signed.expires}&signature={expected}"
    signer.check(PATH, str(signed.expires), signed.signature, now=NOW + 599)


def test_it_expires(signer):
    signed = signer.sign(PATH, 600, now=NOW)
    with pytest.raises(BadSignature, match="expired"):
        signer.check(PATH, str(signed.expires), signed.signature, now=NOW + 600)


@pytest.mark.parametrize("change", ["path", "expires", "signature", "missing", "secret"])
def test_it_opens_nothing_else(signer, change):
    signed = signer.sign(PATH, 600, now=NOW)
    path, expires, signature = PATH, str(signed.expires), signed.signature
    if change == "path":
        path = PATH.replace("adapter_model.safetensors", "adapter_config.json")
    elif change == "expires":
        expires = str(signed.expires + 3600)       # a later expiry under the same signature
    elif change == "signature":
        signature = signature[:-1] + ("0" if signature[-1] != "0" else "1")
    elif change == "missing":
        expires = signature = None
    else:
        signer = Signer(b"j" * SECRET_BYTES)
    with pytest.raises(BadSignature) as refused:
        signer.check(path, expires, signature, now=NOW)
    assert refused.value.category == "permission_denied"


def test_paths_must_be_absolute_without_a_query(signer):
    for bad in ("relative/path", "/a?b=c"):
        with pytest.raises(ValueError):
            signer.sign(bad)


def test_short_secrets_are_refused():
    with pytest.raises(ValueError, match="at least 32"):
        Signer(b"short")


def test_the_secret_is_made_once_owner_only_and_kept(tmp_path):
    first = load_secret(tmp_path)
    path = tmp_path / SECRET_FILE
    assert len(first) == SECRET_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_secret(tmp_path) == first           # a restart keeps its URLs valid
    os.chmod(path, 0o644)
    assert load_secret(tmp_path) == first
    assert stat.S_IMODE(path.stat().st_mode) == 0o600   # narrowed back
    path.write_bytes(b"x")
    with pytest.raises(RuntimeError, match="delete it"):
        load_secret(tmp_path)
