"""Adapters in: an upload through signed PUT URLs (Tinker 0.39's
`external_weights_upload_start` / `_finish`), or a directory on the server's disk
(`twinkle-server adapters import`), becomes an `external_weights` checkpoint of the
caller's, on the base it names.

An upload lives in `<data dir>/uploads/<upload_id>/`: its record (`upload.json`: tenant,
base, LoRA config, expiry) and `files/`, where each signed PUT writes one of
`ADAPTER_FILES` (to a temporary name, renamed when whole onto its name, claimed first: a
second PUT of a file is refused, even one racing the first). `finish` claims
the upload by renaming its folder (`<upload_id>.finishing`: of finishes racing, one wins,
and a PUT still sending finds it gone), checks the files against the base
(`engine.adapter_import`), writes the checkpoint atomically, records its run and
checkpoint rows, and removes the upload; whatever fails leaves no checkpoint, and an
upload never finished is removed once it expires (`expire`).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_server.engine import (
    ADAPTER_FILES,
    WEIGHTS_FILE,
    ImportedAdapter,
    base_linears,
    read_import,
    write_atomically,
)
from twinkle_server.engine.errors import FailedPrecondition, InvalidArgument, NotFound
from twinkle_server.engine.types import ROLE_ATTENTION, ROLE_MLP, ROLE_UNEMBED
from twinkle_server.runtime.audit import checkpoint_details
from twinkle_server.runtime.bases import Served
from twinkle_server.runtime.core import Core
from twinkle_server.runtime.signed_urls import SignedPath, Signer, load_secret
from twinkle_server.store import AuditRow, CheckpointRow, Store

UPLOADS_DIR = "uploads"
UPLOAD_PREFIX = "/api/v1/external_weights_upload"
"""Where the HTTP front takes the signed PUTs (`upload_path`)."""
UPLOAD_TTL_SECONDS = 3600
"""How long an upload's URLs work; an upload not finished by then is removed."""
MAX_UPLOAD_BYTES = 4 << 30
"""Largest `adapter_model.safetensors` taken (rank 128 on every linear of a 70B model is
about 2.7 GB in float32)."""
KIND = "external"


def upload_path(upload_id: str, file: str) -> str:
    return f"{UPLOAD_PREFIX}/{upload_id}/{file}"


@dataclass(frozen=True)
class Started:
    upload_id: str
    paths: dict[str, SignedPath]   # file name -> its signed PUT path
    expires: int


def register(store: Store, tenant: str, base_name: str, base_path: str,
             adapter: ImportedAdapter, source: str) -> CheckpointRow:
    """Write `adapter` as a new run's `external_weights/imported` checkpoint of `tenant`,
    on base `base_name` (`base_path`: what its config names), and record both and the
    import in the audit log; store writes only, so the CLI can do it beside a server."""
    run_id = "run-" + secrets.token_hex(6)
    name = "imported"
    target = store.checkpoint_dir(tenant, run_id, KIND, name)
    size = write_atomically(target, lambda out: adapter.write(out, base_path))
    spec = adapter.spec
    lora = {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout,
            "target_modules": list(adapter.modules), "use_rslora": spec.use_rslora,
            "target_parameters": list(adapter.parameters),
            "seed": None}
    try:
        store.create_run(run_id, tenant, base_name, lora, {"imported_from": source}, None)
        row = CheckpointRow(run_id, KIND, name, tenant,
                            str(target.relative_to(store.checkpoint_root)), size, False,
                            time.time(), {})
        store.add_checkpoint(row)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    store.add_audit(AuditRow(tenant, time.time(), "checkpoint_import",
                             {"actor": tenant, "source": source, "base_model": base_name,
                              **checkpoint_details(row)}))
    return row


class Imports:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.signer = Signer(load_secret(core.store.data_dir))
        self.root = core.store.data_dir / UPLOADS_DIR

    # ------------------------------------------------------------------ upload

    async def start(self, tenant: str, base_model: str, lora: Mapping[str, Any],
                    destination: str | None = None) -> Started:
        """A new upload of an adapter for `base_model` with Tinker's `lora_config`; its
        signed PUT paths, one per file, for the tenant."""
        served = self.core.base(base_model)
        if destination:
            raise InvalidArgument(f"destination_project_id: {destination!r}; this server "
                                  "has tenants, not projects: leave it out")
        config = _lora_config(lora, served.model.max_rank)
        upload_id = "upl-" + secrets.token_hex(8)
        now = time.time()
        expires = int(now + UPLOAD_TTL_SECONDS)
        folder = self.root / upload_id
        (folder / "files").mkdir(parents=True)
        record = {"tenant": tenant, "base_model": served.name, "lora_config": config,
                  "expires": expires}
        (folder / "upload.json").write_text(json.dumps(record))
        paths = {f: self.signer.sign(upload_path(upload_id, f), UPLOAD_TTL_SECONDS, now,
                                     reader=tenant) for f in ADAPTER_FILES}
        self.core.record(tenant, "checkpoint_upload_start", upload_id=upload_id,
                         base_model=served.name)
        return Started(upload_id, paths, expires)

    async def receive(self, upload_id: str, file: str, expires: str | None,
                      signature: str | None, writer: str | None,
                      body: AsyncIterator[bytes]) -> int:
        """One signed PUT: the file's bytes, within its limit, written whole or not at
        all; returns its size. A URL is good for one PUT."""
        self.signer.check(upload_path(upload_id, file), expires, signature, reader=writer)
        self._record(upload_id, writer or "")   # still open
        if file not in ADAPTER_FILES:   # the signature covers the path, so this is ours to say
            raise NotFound(f"file: {file!r} is not part of an upload")
        target = self.root / upload_id / "files" / file
        if target.exists():
            raise _uploaded(file)
        limit = MAX_UPLOAD_BYTES if file == WEIGHTS_FILE else 1 << 20
        partial = target.with_name(f".{file}.{secrets.token_hex(4)}.part")
        size = 0
        try:
            with open(partial, "xb") as out:
                async for chunk in body:
                    size += len(chunk)
                    if size > limit:
                        raise InvalidArgument(f"{file}: over the {limit}-byte limit")
                    out.write(chunk)
            # The name claimed first (created exclusively), then filled by one rename: of
            # two PUTs racing to one URL the second finds it taken, where a plain rename
            # would silently replace the first (and a hard link needs a file system that
            # has them).
            os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            os.replace(partial, target)
        except FileExistsError:
            raise _uploaded(file) from None
        except FileNotFoundError:
            raise NotFound(f"upload_id: {upload_id!r} was finished or expired while {file} "
                           "was being sent") from None
        finally:
            partial.unlink(missing_ok=True)
        return size

    async def finish(self, tenant: str, upload_id: str) -> CheckpointRow:
        """Check the uploaded files against the upload's base and LoRA config; the new
        checkpoint. The upload is removed whether it passes or not."""
        record = self._record(upload_id, tenant)
        # Claimed by a rename: of two finishes racing, one gets the upload, the other
        # finds none; a PUT still streaming finds its folder gone.
        folder = self.root / f"{upload_id}.finishing"
        try:
            os.rename(self.root / upload_id, folder)
        except OSError:
            raise _no_upload(upload_id) from None
        try:
            served = self.core.base(record["base_model"])
            # Reading and checking gigabytes of tensors: off the event loop.
            adapter = await asyncio.to_thread(self._read, folder / "files", served)
            _agree(adapter, record["lora_config"])
            row = await self.core.write(register, self.core.store, tenant, served.name,
                                        served.tokenizer_id, adapter, f"upload {upload_id}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return row

    def _read(self, files: Path, served: Served) -> ImportedAdapter:
        missing = [f for f in ADAPTER_FILES if not (files / f).is_file()]
        if missing:
            raise FailedPrecondition(f"upload: {missing} not uploaded; PUT every file to its "
                                     "URL before finishing")
        return read_import(files, base_linears(served.engine.base.model_dir),
                           served.model.max_rank, MAX_UPLOAD_BYTES)

    def _record(self, upload_id: str, tenant: str) -> dict[str, Any]:
        """The upload's record, if it is `tenant`'s and has not expired (otherwise, as
        for any other tenant's, there is no such upload)."""
        try:
            record = json.loads((self.root / _checked_id(upload_id) / "upload.json")
                                .read_text())
        except (OSError, ValueError):
            record = None
        if record is None or record["tenant"] != tenant or record["expires"] <= time.time():
            raise _no_upload(upload_id)
        return record

    async def expire(self, now: float | None = None) -> None:
        """Remove the uploads whose URLs have expired, finished or not."""
        now = time.time() if now is None else now
        if not self.root.is_dir():
            return
        for folder in self.root.iterdir():
            try:
                expires = json.loads((folder / "upload.json").read_text())["expires"]
            except (OSError, ValueError, KeyError):
                expires = 0
            if expires <= now:
                await self.core.write(shutil.rmtree, folder, True)


def _checked_id(upload_id: str) -> str:
    if not upload_id.startswith("upl-") or not upload_id[4:].isalnum():
        raise NotFound(f"upload_id: no upload {upload_id!r}")
    return upload_id


def _lora_config(lora: Mapping[str, Any], max_rank: int) -> dict[str, Any]:
    """Tinker's `LoraConfig` of an upload: the rank, and which layer groups it trains."""
    extra = sorted(set(lora) - {"rank", "seed", "train_mlp", "train_attn", "train_unembed"})
    if extra:
        raise InvalidArgument(f"lora_config.{extra[0]}: not a LoraConfig field")
    rank = lora.get("rank")
    if type(rank) is not int or not 1 <= rank <= max_rank:
        raise InvalidArgument(f"lora_config.rank: {rank!r}; give an integer in [1, {max_rank}]")
    if lora.get("seed") is not None:
        raise InvalidArgument("lora_config.seed: an upload brings its own weights; leave the "
                              "seed out")
    out: dict[str, Any] = {"rank": rank}
    for key in ("train_mlp", "train_attn", "train_unembed"):
        value = lora.get(key, True)
        if not isinstance(value, bool):
            raise InvalidArgument(f"lora_config.{key}: {value!r}; give true or false")
        out[key] = value
    return out


SWITCHES = {ROLE_MLP: "train_mlp", ROLE_ATTENTION: "train_attn", ROLE_UNEMBED: "train_unembed"}
"""The Tinker switch that trains each role (`engine.roles`); routers and linears of no
known part are in none. MoE expert parameters are `train_mlp`'s."""


def _agree(adapter: ImportedAdapter, lora: Mapping[str, Any]) -> None:
    """The uploaded adapter is the one `external_weights_upload_start` announced: its
    rank, and layers only of the roles it said it trains (by the base's structure, as the
    switches select them when training: fused and linear-attention layers included)."""
    if adapter.spec.rank != lora["rank"]:
        raise InvalidArgument(f"adapter_config.json: r is {adapter.spec.rank}, the upload "
                              f"was started with lora_config.rank {lora['rank']}")
    roles = {**adapter.roles, **{p: ROLE_MLP for p in adapter.parameters}}
    for module in (*adapter.modules, *adapter.parameters):
        group = SWITCHES.get(roles.get(module) or "")
        if group is not None and not lora[group]:
            raise InvalidArgument(f"adapter_model.safetensors: adapts {module!r}, but the "
                                  f"upload was started with lora_config.{group} false")


def _no_upload(upload_id: str) -> NotFound:
    return NotFound(f"upload_id: no upload {upload_id!r} (finished, expired, or never "
                    "started)")


def _uploaded(file: str) -> FailedPrecondition:
    return FailedPrecondition(f"{file}: already uploaded; a signed URL takes one PUT")
