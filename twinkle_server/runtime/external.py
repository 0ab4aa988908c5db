"""External weights (`save_weights_external`): an adapter exported in Hugging Face/PEFT
format, optionally age-encrypted, downloadable through signed, expiring URLs.

- `save` is an ordered op of the model, like `save_weights`: the adapter's PEFT files
  (`adapter_config.json`, `adapter_model.safetensors`; `peft.PeftModel.from_pretrained`
  loads them) become checkpoint `<run_id>/external_weights/<name>`, listed, TTL'd,
  published and deleted like the others (store kind "external", the SDK's
  `CheckpointType`). With age recipients (`age1...` or SSH public keys, at most 10) every
  file is encrypted to all of them by `pyrage` and stored as `<file>.age`, what the SDK
  documents and the cookbook's `weights.download` decrypts. Every refusal (bad name, TTL
  or recipient) still takes the op's seq_id.
- `urls` signs one URL per file (`signed_urls`): `GET /api/v1/external_weights/<run_id>/
  <name>/<file>?expires=...&signature=...` on the HTTP front, which opens without an API
  key until it expires, and `open` is what that route checks before it sends a file.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_server.config.served import Front
from twinkle_server.engine import CONFIG_FILE, write_atomically
from twinkle_server.engine.errors import EngineError, FailedPrecondition, InvalidArgument, NotFound
from twinkle_server.runtime.audit import checkpoint_details
from twinkle_server.runtime.core import Core
from twinkle_server.runtime.runs import check_ttl
from twinkle_server.runtime.signed_urls import (
    DEFAULT_URL_TTL_SECONDS,
    SignedPath,
    Signer,
    load_secret,
)
from twinkle_server.runtime.values import CheckpointRef, OpRef
from twinkle_server.store import CheckpointRow
from twinkle_wire import paths

KIND = "external"
AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10
"""The SDK's documented limit on `age_encryption_recipients`."""
DOWNLOAD_PREFIX = "/api/v1/external_weights"
"""Where the HTTP front serves the files of external checkpoints (`download_path`)."""


@dataclass(frozen=True)
class SignedUrls:
    """One signed path per file of an external checkpoint, and when they expire."""

    paths: dict[str, SignedPath]
    expires: int


def download_path(run_id: str, name: str, file: str) -> str:
    return f"{DOWNLOAD_PREFIX}/{run_id}/{name}/{file}"


def parse_recipients(values: Sequence[str] | None) -> list[Any]:
    """age recipients (`age1...` X25519 keys or `ssh-ed25519`/`ssh-rsa` public keys) as
    pyrage objects; a malformed one is refused naming its index."""
    import pyrage

    values = list(values or ())
    if len(values) > MAX_RECIPIENTS:
        raise InvalidArgument(f"age_encryption_recipients: {len(values)} given; at most "
                              f"{MAX_RECIPIENTS}")
    out = []
    for i, text in enumerate(values):
        text = str(text).strip()
        kind = pyrage.ssh if text.startswith("ssh-") else pyrage.x25519
        try:
            out.append(kind.Recipient.from_str(text))
        except pyrage.RecipientError as exc:
            raise InvalidArgument(
                f"age_encryption_recipients[{i}]: {text[:40]!r} is not an age recipient "
                f"({exc}); give an 'age1...' key or an SSH public key") from None
    return out


class External:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.signer = Signer(load_secret(core.store.data_dir))
        self.http: Front | None = None
        """Set by the server when the HTTP front listens; the gRPC front needs it to say
        where signed URLs point."""

    # ------------------------------------------------------------------ export

    async def save(self, tenant: str, ref: OpRef, name: str, *, ttl_seconds: int | None = None,
                   recipients: Sequence[str] | None = None) -> CheckpointRow:
        """Export the adapter as `external_weights/<name>` (encrypted to `recipients` when
        given), expiring `ttl_seconds` from now (None: never); op `ref.seq_id`."""
        core, mid = self.core, ref.model_id
        core.model_of(tenant, mid)
        try:
            name = paths.check_name(name, "path")
            check_ttl(ttl_seconds)
            age = parse_recipients(recipients)
        except (EngineError, paths.PathError) as exc:
            return await core.refuse(mid, ref.seq_id, "save_external", exc, ref.request_id)
        target = core.store.checkpoint_dir(tenant, mid, KIND, name)
        served = core.base_of(mid)
        # What a reader resolves: a hub id when the model has one, else its directory.
        base_name = served.tokenizer_id

        def save() -> CheckpointRow:
            if target.exists():
                raise FailedPrecondition(f"path: external weights {name!r} already exist; "
                                         "choose another name or delete them first")
            target.parent.mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix=f".{name}.export-", dir=target.parent))
            try:
                plain = scratch / "plain"
                served.engine.save_weights(mid, plain)
                _name_base_model(plain / CONFIG_FILE, base_name)
                size = write_atomically(target, lambda out: _fill(out, plain, age))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            now = time.time()
            row = CheckpointRow(mid, KIND, name, tenant,
                                str(target.relative_to(core.store.checkpoint_root)), size,
                                False, now, {}, expires_at=(
                                    None if ttl_seconds is None else now + ttl_seconds))
            core.store.add_checkpoint(row)
            core.record(tenant, "checkpoint_save", encrypted=bool(age), **checkpoint_details(row))
            return row

        return await core.ordered(tenant, ref, "save_external", save)

    # ------------------------------------------------------------------ download

    def urls(self, tenant: str, ref: CheckpointRef,
             ttl_seconds: int = DEFAULT_URL_TTL_SECONDS) -> SignedUrls:
        """A signed download path for every file of an external checkpoint the tenant
        may read (its own, or one published). Each URL names the tenant it was signed
        for (signed with the rest), so a download through it is that tenant's read in
        the audit log, whoever holds the URL."""
        row, directory = self.core.checkpoint(tenant, ref)   # another's: not found
        if ref.kind != KIND:
            raise InvalidArgument(f"{ref.field}: {ref.text!r} is not external weights; only "
                                  "tinker://<run_id>/external_weights/<name> has download URLs "
                                  "(save one with save_weights_external)")
        now = time.time()
        signed = {f: self.signer.sign(download_path(row.run_id, row.name, f), ttl_seconds, now,
                                      reader=tenant)
                  for f in _files(directory)}
        return SignedUrls(signed, int(now + ttl_seconds))

    def open(self, run_id: str, name: str, file: str, expires: str | None,
             signature: str | None, reader: str | None = None) -> Path:
        """The file a signed download URL names, once its signature and expiry check out
        and its checkpoint still exists (raises `BadSignature` or `NotFound`); recorded
        as a `checkpoint_read` (purpose "download") of the tenant the URL was signed for
        (`reader`; a URL signed before URLs named one: the owner).

        A reader that could read the checkpoint when the URL was signed may download
        through it until it expires, even if the owner unpublished it since: the URL is
        the grant, as it is for whoever holds it."""
        self.signer.check(download_path(run_id, name, file), expires, signature, reader=reader)
        row = self.core.store.find_checkpoint(run_id, KIND, name)
        if row is None or (row.expires_at is not None and row.expires_at <= time.time()):
            raise NotFound(f"external weights {run_id}/{name}: deleted or expired")
        directory = self.core.store.checkpoint_root / row.rel_path
        if file not in _files(directory):
            raise NotFound(f"external weights {run_id}/{name}: no file {file!r}")
        self.core.record(reader or row.tenant, "checkpoint_read", purpose="download",
                         file=file, via="signed_url", **checkpoint_details(row))
        return directory / file

    def endpoint(self) -> Front:
        """Where signed URLs point, for a front that is not the HTTP one."""
        if self.http is None:
            raise FailedPrecondition("external weights URLs: this server has no HTTP front, "
                                     "which serves the downloads; start it with --http-port "
                                     "(0 picks a free port)")
        return self.http


def _files(directory: Path) -> list[str]:
    """The checkpoint's files (an export is flat: no sub-directories)."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if p.is_file())


def _name_base_model(config_path: Path, base_name: str) -> None:
    """Point the export's `base_model_name_or_path` at a name a reader can resolve (the
    engine writes the server's local model directory)."""
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_name
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def _fill(out: Path, plain: Path, recipients: list[Any]) -> None:
    """Copy the PEFT files from `plain` into `out`, each encrypted to `recipients` (as
    `<file>.age`) when there are any."""
    import pyrage

    for source in sorted(plain.iterdir()):
        if not recipients:
            shutil.copyfile(source, out / source.name)
            continue
        try:
            pyrage.encrypt_file(str(source), str(out / (source.name + AGE_SUFFIX)), recipients)
        except pyrage.EncryptError as exc:
            raise FailedPrecondition(f"age_encryption_recipients: encryption failed: {exc}"
                                     ) from None
