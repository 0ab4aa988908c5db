"""What the services share: config, engine, scheduler, store, and who owns which model.

Every change to the engine (adding or removing an adapter, any compute) goes through the
scheduler's single worker, so the engine never sees two threads. The services only read
registry facts here and await futures.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from twinkle_server.config import ServerConfig
from twinkle_server.engine.engine import Engine
from twinkle_server.executor import EngineExecutor
from twinkle_server.scheduler import Op, Scheduler, default_token_budget
from twinkle_server.service.errors import ServiceError
from twinkle_server.store import Store

log = logging.getLogger("twinkle_server")
OPEN_TENANT = "local"
ADMIN_QUEUE = "__admin__"


@dataclass
class ModelEntry:
    """A loaded adapter: which tenant and session own it."""

    model_id: str
    tenant: str
    session_id: str | None
    base_model: str


@dataclass
class SamplerEntry:
    session_id: str
    tenant: str
    model_id: str | None       # live adapter
    weights_path: str | None   # sampler checkpoint directory
    base_model: str


@dataclass
class Runtime:
    config: ServerConfig
    engine: Engine
    store: Store
    scheduler: Scheduler = field(init=False)
    models: dict[str, ModelEntry] = field(default_factory=dict)
    samplers: dict[str, SamplerEntry] = field(default_factory=dict)
    draining: bool = False

    def __post_init__(self) -> None:
        budget = (self.config.merge_token_budget
                  or default_token_budget(self.engine.base.device.type))
        self.scheduler = Scheduler(EngineExecutor(self.engine), mode=self.config.scheduling,
                                   token_budget=budget)
        self.scheduler.register_model(ADMIN_QUEUE)
        self.open_mode = not self.store.has_keys()

    # ------------------------------------------------------------------ names

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.config.model, *self.config.model_alias)

    def check_base_model(self, name: str) -> str:
        if name and name not in self.model_names:
            raise ServiceError("invalid_argument",
                               f"base_model: {name!r} is not served here; served names are "
                               f"{list(self.model_names)}")
        return self.config.model

    # ------------------------------------------------------------------ auth

    def tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The calling tenant from `authorization: Bearer <key>`; raises UNAUTHENTICATED."""
        if self.draining:
            raise ServiceError("unavailable", "the server is shutting down")
        if self.open_mode:
            return OPEN_TENANT
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                token = value[7:] if value.startswith("Bearer ") else ""
                tenant = self.store.tenant_for_key(token) if token else None
                if tenant is not None:
                    return tenant
                break
        raise ServiceError("unauthenticated",
                           "authorization: missing or invalid API key (send 'Bearer <key>')")

    def model_of(self, tenant: str, model_id: str) -> ModelEntry:
        entry = self.models.get(model_id)
        if entry is None or entry.tenant != tenant:
            raise ServiceError("not_found", f"model_id: no model {model_id!r}")
        return entry

    def sampler_of(self, tenant: str, session_id: str) -> SamplerEntry:
        entry = self.samplers.get(session_id)
        if entry is None or entry.tenant != tenant:
            raise ServiceError("not_found", f"sampling_session_id: no sampling session "
                                            f"{session_id!r}")
        return entry

    # ------------------------------------------------------------------ ops

    async def run(self, op: Op) -> Any:
        """Submit to the scheduler and await the result; failures raise."""
        start = time.perf_counter()
        try:
            return await asyncio.wrap_future(self.scheduler.submit(op))
        finally:
            log.info("op model=%s seq=%s op=%s tokens=%d ms=%.1f", op.queue_id, op.seq_id,
                     op.kind, op.tokens, (time.perf_counter() - start) * 1000)

    async def admin(self, kind: str, fn: Callable[[], Any]) -> Any:
        """Run an engine mutation (add/remove adapter, load weights) on the worker."""
        return await self.run(Op(ADMIN_QUEUE, None, kind, None, 0, fn))

    def new_model_id(self) -> str:
        return "run-" + secrets.token_hex(6)

    async def unload(self, model_id: str, reason: str) -> None:
        """Free an adapter's slot; its run record and checkpoints stay."""
        entry = self.models.pop(model_id, None)
        if entry is None:
            return
        self.scheduler.unregister(model_id, ServiceError("failed_precondition",
                                                         f"model_id: {model_id!r} was unloaded "
                                                         f"({reason})"))
        await self.admin("unload", lambda: self.engine.remove_adapter(model_id))
        log.info("unloaded model=%s tenant=%s (%s)", model_id, entry.tenant, reason)

    async def expire_sessions(self) -> None:
        for session_id in self.store.expired_sessions(self.config.session_timeout):
            self.store.close_session(session_id)
            await self.close_session_models(session_id, "session expired")

    async def close_session_models(self, session_id: str, reason: str) -> None:
        for model_id in [m for m, e in self.models.items() if e.session_id == session_id]:
            await self.unload(model_id, reason)
        for sid in [s for s, e in self.samplers.items() if e.session_id == session_id]:
            self.samplers.pop(sid, None)
            self.scheduler.unregister(sid, ServiceError("failed_precondition", reason))
