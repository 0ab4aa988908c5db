"""copy_weights: a checkpoint the tenant may read, copied into a new run the tenant owns.

Tinker's `RestClient.copy_weights(path, destination_project_id, ttl_seconds=,
weights_access_token=)` semantics, mapped onto tenants:

- the source is any checkpoint the caller may read (its own, or a published one), or,
  with `weights_access_token`, one the token's tenant may read (the token is that
  tenant's API key: Twinkle has no other access tokens);
- the copy keeps the source's kind, name, metadata and files, belongs to a new training
  run of the caller (the source run's base model and LoRA config, no adapter loaded: it
  is trained on only by loading it into a new model), starts private, and expires after
  `ttl_seconds` if given (the source's expiry is not inherited);
- storage is shared: files are hard links (a copy only where the file system cannot
  link), so no bytes are duplicated; checkpoints are written once and replaced by
  rename, never in place, so a later save over the source leaves the copy as it was;
- the SDK sends one `X-Idempotency-Key` per call and retries with it: a retry answers
  the copy the first attempt made (found through its audit entry, so across restarts);
  the same key with another source is not a retry, and is refused;
- Twinkle has no projects: `destination_project_id` is accepted and recorded, nothing
  more. With `session_id`, the new run is listed under that session of the caller.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from pathlib import Path

from twinkle_server.engine.errors import InvalidArgument, NotFound, Unauthenticated
from twinkle_server.runtime.audit import checkpoint_details, record
from twinkle_server.runtime.core import Core
from twinkle_server.runtime.runs import check_ttl
from twinkle_server.runtime.values import CheckpointRef, checkpoint_ref
from twinkle_server.store import AuditRow, CheckpointRow

COPY_EVENT = "checkpoint_copy"
MAX_IDEMPOTENCY_KEY_CHARS = 200
"""Longest idempotency key taken (the SDK sends a 36-character UUID)."""


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:   # another file system, or links not supported
        shutil.copy2(source, target)


def link_tree(source: Path, target: Path) -> None:
    """`target` as a tree of hard links to `source`'s files, put in place by one rename
    (never a half copy under the real name)."""
    scratch = target.parent / f".copy-{secrets.token_hex(6)}"
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(source, scratch, copy_function=_link_or_copy)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class Copies:
    def __init__(self, core: Core) -> None:
        self.core = core

    def reader_of(self, token: str) -> str:
        """The tenant whose API key `token` is (the SDK sends keys as `tml-...`, so a
        legacy `tw-...` key arrives as `tml-tw-...`)."""
        for candidate in dict.fromkeys((token, token.removeprefix("tml-"))):
            try:
                return self.core.authenticate(candidate)
            except Unauthenticated:
                pass
        raise Unauthenticated("weights_access_token: not an active API key of this server")

    async def copy(self, tenant: str, source: CheckpointRef, *, reader: str | None = None,
                   session_id: str | None = None, ttl_seconds: int | None = None,
                   destination: str = "", idempotency_key: str = "") -> CheckpointRow:
        """Copy `source` (readable by `reader`, default the tenant) into a new run of
        `tenant`; returns the copy's record. See the module docstring."""
        core, store = self.core, self.core.store
        check_ttl(ttl_seconds)
        if idempotency_key:
            done = store.find_audit(tenant, COPY_EVENT, "idempotency_key", idempotency_key)
            first = done and checkpoint_ref(done.details["source"], source.field)
            if first and (first.run_id, first.kind, first.name) != (
                    source.run_id, source.kind, source.name):
                raise InvalidArgument(
                    f"idempotency_key: {idempotency_key!r} was used for a copy of "
                    f"{first.text!r}; a copy of {source.text!r} needs a key of its own")
            copied = done and store.get_checkpoint(tenant, done.details["model_id"],
                                                   done.details["checkpoint_type"],
                                                   done.details["name"])
            if copied:
                return copied
        if session_id and store.session_tenant(session_id) != tenant:
            raise NotFound(f"session_id: no open session {session_id!r}")
        row, directory = core.checkpoint(reader or tenant, source)
        run = store.get_run(row.tenant, row.run_id)
        if run is None:
            raise NotFound(f"{source.field}: no training run for {source.text!r}")
        run_id = core.new_model_id()
        target = store.checkpoint_dir(tenant, run_id, row.kind, row.name)
        now = time.time()

        def copy() -> CheckpointRow:
            link_tree(directory, target)
            store.create_run(run_id, tenant, run.base_model, run.lora,
                             {"copied_from": source.text}, session_id or None)
            copied = CheckpointRow(run_id, row.kind, row.name, tenant,
                                   str(target.relative_to(store.checkpoint_root)),
                                   row.size_bytes, row.has_optimizer, now,
                                   dict(row.user_metadata), False,
                                   None if ttl_seconds is None else now + ttl_seconds)
            store.add_checkpoint(copied)
            # Written with the copy (not later): a retry looks for it.
            store.add_audit(AuditRow(tenant, now, COPY_EVENT, {
                "actor": tenant, **checkpoint_details(copied), "name": copied.name,
                "source": source.text, "destination_project_id": destination,
                "idempotency_key": idempotency_key}))
            return copied

        copied = await core.write(copy)
        record(core, tenant, "checkpoint_read", purpose="copy", **checkpoint_details(row))
        return copied
