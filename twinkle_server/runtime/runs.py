"""Session, run and checkpoint verbs, and what the server offers (capabilities, tokenizer
files). Everything a tenant lists or reads is scoped to that tenant, except checkpoints
their owners published: every tenant may read those (load, sample, weights info,
download), and only the owner may change or delete them."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_server.engine import (
    LOSS_NAMES,
    OPTIMIZERS,
    SCHEDULERS,
    available_memory_bytes,
)
from twinkle_server.engine.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from twinkle_server.engine.types import tinker_switches
from twinkle_server.runtime import audit
from twinkle_server.runtime.bases import Served
from twinkle_server.runtime.core import Core
from twinkle_server.runtime.lifetimes import Lifetimes
from twinkle_server.runtime.values import CheckpointRef, check_metadata
from twinkle_server.store import CheckpointRow, RunRow, SessionRow

DEFAULT_PAGE = 20
MAX_PAGE = 1000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json", "generation_config.json", "config.json")
MIN_CHECKPOINT_TTL_SECONDS = 3600
MAX_CHECKPOINT_TTL_SECONDS = 10 * 365 * 24 * 3600
"""The range of a checkpoint's time to live: 1 hour to 10 years, as the Tinker SDK
documents for `set_checkpoint_ttl_from_tinker_path`."""


@dataclass(frozen=True)
class RunView:
    """A run with what a listing shows beside it."""

    run: RunRow
    loaded: bool
    last_checkpoint: CheckpointRow | None
    last_sampler_checkpoint: CheckpointRow | None


@dataclass(frozen=True)
class SessionView:
    """A session with its runs (from the store) and live sampling sessions."""

    session: SessionRow
    run_ids: list[str]
    sampler_ids: list[str]


@dataclass(frozen=True)
class Page:
    items: list[Any]
    total: int
    next_offset: int     # -1 when this page is the last


def check_ttl(ttl_seconds: int | None) -> None:
    """Refuse a checkpoint time to live outside the allowed range (`None`: no expiry)."""
    if ttl_seconds is not None and not (
            MIN_CHECKPOINT_TTL_SECONDS <= ttl_seconds <= MAX_CHECKPOINT_TTL_SECONDS):
        raise InvalidArgument(
            f"ttl_seconds: {ttl_seconds} is out of range; give {MIN_CHECKPOINT_TTL_SECONDS} "
            f"(1 hour) to {MAX_CHECKPOINT_TTL_SECONDS} (10 years), or null for no expiry")


def run_switches(run: RunRow | None) -> dict[str, bool]:
    """The Tinker switches (`train_attn`, `train_mlp`, `train_unembed`) a run was made
    with; empty for a run made with module names, or no run."""
    return (tinker_switches(run.lora["target_modules"]) if run else None) or {}


def _page(limit: int, offset: int) -> tuple[int, int]:
    if limit < 0 or offset < 0:
        raise InvalidArgument("limit, offset: must be >= 0")
    return min(limit or DEFAULT_PAGE, MAX_PAGE), offset


class Runs:
    def __init__(self, core: Core, lifetimes: Lifetimes) -> None:
        self.core = core
        self.lifetimes = lifetimes

    # ------------------------------------------------------------------ sessions

    async def create_session(self, tenant: str, tags: dict[str, str]) -> str:
        core = self.core
        if core.store.open_sessions(tenant) >= core.config.max_sessions_per_tenant:
            raise ResourceExhausted(
                f"sessions: tenant has {core.config.max_sessions_per_tenant} open sessions "
                "(--max-sessions-per-tenant); close one first")
        session_id = await core.write(core.store.create_session, tenant,
                                      check_metadata(tags, "tags"))
        audit.record(core, tenant, "session_create", session_id=session_id)
        return session_id

    def _own_session(self, tenant: str, session_id: str) -> None:
        if self.core.store.session_tenant(session_id) != tenant:
            raise NotFound(f"session_id: no open session {session_id!r}")

    async def heartbeat(self, tenant: str, session_id: str) -> None:
        self._own_session(tenant, session_id)
        await self.core.write(self.core.store.heartbeat, session_id)

    async def close_session(self, tenant: str, session_id: str) -> None:
        self._own_session(tenant, session_id)
        await self.core.write(self.core.store.close_session, session_id)
        audit.record(self.core, tenant, "session_close", session_id=session_id)
        await self.lifetimes.close_session_models(session_id, "session closed")

    def list_sessions(self, tenant: str, limit: int = 0, offset: int = 0) -> Page:
        """Every session the tenant created, open or closed, newest first:
        `Page.items` holds `SessionRow`s."""
        limit, offset = _page(limit, offset)
        rows, total = self.core.store.list_sessions(tenant, limit, offset)
        following = offset + len(rows)
        return Page(rows, total, following if following < total else -1)

    def get_session(self, tenant: str, session_id: str) -> SessionView:
        """One of the tenant's sessions, open or closed, with its runs and samplers."""
        store = self.core.store
        session = store.get_session(tenant, session_id)
        if session is None:
            raise NotFound(f"session_id: no session {session_id!r}")
        samplers = [s for s, e in self.core.samplers.items()
                    if e.tenant == tenant and e.session_id == session_id]
        return SessionView(session, store.session_runs(tenant, session_id), samplers)

    # ------------------------------------------------------------------ runs

    def _view(self, run: RunRow) -> RunView:
        rows, _ = self.core.store.list_checkpoints(run.tenant, run.run_id)
        return RunView(run, run.run_id in self.core.models,
                       next((r for r in rows if r.kind == "training"), None),
                       next((r for r in rows if r.kind == "sampler"), None))

    def list_runs(self, tenant: str, limit: int = 0, offset: int = 0) -> Page:
        limit, offset = _page(limit, offset)
        runs, total = self.core.store.list_runs(tenant, limit, offset)
        following = offset + len(runs)
        return Page([self._view(r) for r in runs], total,
                    following if following < total else -1)

    def run_of(self, row: CheckpointRow) -> RunRow | None:
        """The run a checkpoint belongs to (its owner's): its base model and LoRA rank."""
        return self.core.store.get_run(row.tenant, row.run_id)

    def get_run(self, tenant: str, run_id: str) -> RunView:
        run = self.core.store.get_run(tenant, run_id)
        if run is None:
            raise NotFound(f"run_id: no run {run_id!r}")
        return self._view(run)

    # ------------------------------------------------------------------ checkpoints

    def list_checkpoints(self, tenant: str, run_id: str = "", limit: int = 0,
                         offset: int = 0) -> Page:
        """Checkpoints (all the tenant's, or one run's), newest first, each paired with
        its run: `Page.items` holds `(CheckpointRow, RunRow | None)`."""
        store = self.core.store
        if run_id and store.get_run(tenant, run_id) is None:
            raise NotFound(f"run_id: no run {run_id!r}")
        limit, offset = _page(limit or MAX_PAGE, offset)
        rows, total = store.list_checkpoints(tenant, run_id or None, limit, offset)
        runs = {r.run_id: store.get_run(tenant, r.run_id) for r in rows}
        following = offset + len(rows)
        return Page([(r, runs[r.run_id]) for r in rows], total,
                    following if following < total else -1)

    def get_checkpoint(self, tenant: str, ref: CheckpointRef
                       ) -> tuple[CheckpointRow, RunRow | None]:
        """A checkpoint the tenant may read, with its run (the owner's, for a published
        one: its base model and LoRA rank say how to load it)."""
        row, _ = self.core.checkpoint(tenant, ref)
        return row, self.run_of(row)

    async def delete_checkpoint(self, tenant: str, ref: CheckpointRef) -> None:
        row, _ = self.core.own_checkpoint(tenant, ref)
        await self.core.drop_checkpoint(row)
        audit.record(self.core, tenant, "checkpoint_delete", **audit.checkpoint_details(row))

    async def publish_checkpoint(self, tenant: str, ref: CheckpointRef, public: bool) -> None:
        """Make the tenant's checkpoint readable by every tenant (`public`), or by its
        owner only again. Refused when it already is."""
        row, _ = self.core.own_checkpoint(tenant, ref)
        if row.public == public:
            raise FailedPrecondition(f"{ref.field}: {ref.text!r} is already "
                                     f"{'public' if public else 'private'}")
        await self.core.write(self.core.store.set_checkpoint_public, row, public)
        audit.record(self.core, tenant, "checkpoint_publish" if public else
                     "checkpoint_unpublish", **audit.checkpoint_details(row))

    async def set_checkpoint_ttl(self, tenant: str, ref: CheckpointRef,
                                 ttl_seconds: int | None) -> float | None:
        """Make the tenant's checkpoint expire `ttl_seconds` from now (the expiry sweep,
        `Lifetimes.expire_checkpoints`, then deletes it), or never (`None`). Returns the
        expiry time."""
        check_ttl(ttl_seconds)
        row, _ = self.core.own_checkpoint(tenant, ref)
        expires_at = None if ttl_seconds is None else time.time() + ttl_seconds
        await self.core.write(self.core.store.set_checkpoint_expiry, row, expires_at)
        audit.record(self.core, tenant, "checkpoint_ttl_set", ttl_seconds=ttl_seconds,
                     **audit.checkpoint_details(row))
        return expires_at

    def checkpoint_files(self, tenant: str, ref: CheckpointRef) -> tuple[Path, list[str]]:
        """A checkpoint's directory and the names of its files, for a download (recorded
        as the tenant's `checkpoint_read`, purpose "download")."""
        row, directory = self.core.checkpoint(tenant, ref)
        audit.record(self.core, tenant, "checkpoint_read", purpose="download",
                     **audit.checkpoint_details(row))
        return directory, sorted(p.name for p in directory.iterdir() if p.is_file())

    # ------------------------------------------------------------------ the server

    def tokenizer_files(self, model: str) -> tuple[Path, list[str]]:
        """A served model's tokenizer directory and the names of its files (`model`
        empty: the first served)."""
        root = self.core.base(model, "model").engine.base.model_dir
        return root, [n for n in TOKENIZER_FILES if (root / n).is_file()]

    def capabilities(self) -> dict[str, Any]:
        """Every served model with its role and limits, free adapter slots and memory,
        and the names of every loss, optimizer and scheduler."""
        core = self.core
        models = [served_model(served) for served in core.bases]
        return {
            "models": models, "adapters_loaded": len(core.models),
            "adapters_free": sum(m["adapters_free"] for m in models),
            "memory_available_bytes": available_memory_bytes(
                core.bases.default.engine.base.device) or 0,
            "loss_functions": sorted(LOSS_NAMES),
            "optimizers": sorted(OPTIMIZERS), "lr_schedulers": sorted(SCHEDULERS),
        }


def served_model(served: Served) -> dict[str, Any]:
    """What the server says of one served model: names, shape, role, limits, and its
    adapter slots in use."""
    base, model = served.engine.base, served.model
    loaded, resident = len(served.engine.adapters), served.engine.paging_stats().resident
    return {
        "name": model.name, "aliases": list(model.aliases), "arch": base.arch,
        "role": model.role, "trainable": model.trains, "sampleable": True,
        "max_context_length": min(model.max_seq_len, base.max_seq_len),
        "vocab_size": base.vocab_size, "tokenizer_id": served.tokenizer_id,
        "adapters_loaded": loaded,
        "adapters_free": max(0, model.max_adapters - resident) if model.trains else 0,
        "limits": {"max_adapters": model.max_adapters, "max_rank": model.max_rank,
                   "max_seq_len": model.max_seq_len,
                   "max_batch_tokens": model.max_batch_tokens},
    }
