"""The runtime's state: who owns which model, op submission, auth and the store writer.

Every change to the engine (adding or removing an adapter, any compute) goes through the
scheduler's single worker, so the engine never sees two threads. Store writes go through
one writer thread of their own, so a slow disk never stalls the event loop (heartbeats,
health checks, other tenants' cheap calls); reads stay on the loop, on a connection of
their own (`Store`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import shutil
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

from twinkle_server.config.flags import ServerConfig
from twinkle_server.config.model_table import ModelConfig
from twinkle_server.engine.errors import (
    Cancelled,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from twinkle_server.engine.protocol import EngineAPI
from twinkle_server.engine.types import ForwardOutput, Generation
from twinkle_server.runtime.bases import ADMIN_QUEUE, Bases, Served, serve_all
from twinkle_server.runtime.traces import Traces
from twinkle_server.runtime.values import (
    CheckpointRef,
    ModelEntry,
    OpRef,
    Refusal,
    SamplerEntry,
)
from twinkle_server.scheduling.planning import Op
from twinkle_server.scheduling.queues import UnknownQueue
from twinkle_server.store import AuditRow, CheckpointRow, RunRow, Store
from twinkle_wire import paths

log = logging.getLogger("twinkle_server")
T = TypeVar("T")
OpObserver = Callable[[str, Op, float, Any, "BaseException | None"], None]
SUBMITTED: ContextVar[asyncio.Future | None] = ContextVar("twinkle_submitted", default=None)
"""Set by a front that answers before its op runs (HTTP's futures): `run` resolves it as
soon as the op is submitted, with the op's refusal past its bounds (`ResourceExhausted`,
which took nothing) or None, so the front answers that refusal itself (HTTP 429, which
the SDK retries) rather than in the op's future."""

OPEN_TENANT = "local"
SNAPSHOT_DIR = "sampler-snapshots"
"""Where, in the data dir, the weights of snapshot sampling sessions (Tinker's ephemeral
`save_weights_and_get_sampling_client`) live, one directory per session, named by its
id: apart from `checkpoints/`, so no listing, expiry sweep or size total ever sees them."""


class Core:
    """Config, the served base models (`runtime.bases`: an engine and a scheduler each)
    and store, and the registry of loaded models and sampling sessions. The verb groups
    (`runtime.training`, `.sampling`, `.runs`) build on it; fronts call those verbs with
    an authenticated tenant.

    `engines` is one engine (serving the config's one model) or each configured model
    with its engine (`launch.load_engines`)."""

    def __init__(self, config: ServerConfig,
                 engines: EngineAPI | Sequence[tuple[ModelConfig, EngineAPI]],
                 store: Store) -> None:
        if not isinstance(engines, Sequence):
            engines = [(config.model_configs()[0], engines)]
        self.config = config
        self.bases = Bases(serve_all(config, engines))
        self.store = store
        self.models: dict[str, ModelEntry] = {}
        self.samplers: dict[str, SamplerEntry] = {}
        # No sampling session outlives the process, so neither do their snapshots: a
        # restart starts with none (restart-safe cleanup, whatever the last exit was).
        self.snapshot_root = store.data_dir / SNAPSHOT_DIR
        shutil.rmtree(self.snapshot_root, ignore_errors=True)
        self.draining = False
        self.open_mode = not store.has_keys()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="store-writer")
        self._closed = False
        # Likewise no session: one the last process left open (killed before `close`)
        # holds no model here and must not count against --max-sessions-per-tenant.
        self._close_sessions("server restarted")
        self.sweeps: list[Callable[[], Awaitable[None]]] = []
        """What the periodic sweep runs (`expire`): each verb group adds its own."""
        self.observe_op: OpObserver | None = None
        """Called after every op with (base model name, op, seconds, result, error):
        the metrics hook."""
        self.traces = Traces()
        """Each session's recent ops, for its trace (`runtime.traces`)."""
        self.last_op: dict[str, float] = {}
        """Each client session's last op start or end (`time.time()`): liveness the
        expiry sweep reads beside heartbeats (the SDK beats every 10 s, a busy loop
        runs ops in between), kept here, not a store write per op."""
        self.ops_in_flight: dict[str, list[Op]] = {}
        """Each client session's ops submitted and not ended: a session is alive while
        one of them runs or waits its turn, however long the queue holds it
        (`session_busy`)."""

    def close(self) -> None:
        """Record the models and sampling sessions the process takes with it (they are
        gone at the next start), close the client sessions, finish the queued store
        writes; the caller closes the store after. A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for entry in self.models.values():
            self.record(entry.tenant, "model_unload", model_id=entry.model_id,
                        reason="server stopped")
        for sampling_id, sampler in self.samplers.items():
            self.record(sampler.tenant, "sampler_end", sampling_session_id=sampling_id,
                        reason="server stopped")
        self._close_sessions("server stopped")
        self._writer.shutdown(wait=True)

    def _close_sessions(self, reason: str) -> None:
        """Close every open session in the store, each recorded with `reason`, on the
        writer thread."""
        def close() -> None:
            for session_id, tenant in self.store.close_open_sessions():
                self.store.add_audit(AuditRow(tenant, time.time(), "session_close", {
                    "actor": tenant, "session_id": session_id, "reason": reason}))
        self.write_later(close)

    # ------------------------------------------------------------------ store writes

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store write on the writer thread, in submission order, and await it (a
        read that must see the writes queued before it runs there too)."""
        return await asyncio.wrap_future(self._writer.submit(fn, *args))

    def write_later(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue a store write nobody waits for (a run's last request time)."""
        future = self._writer.submit(fn, *args)
        future.add_done_callback(_log_write_failure)

    def record(self, tenant: str, event: str, **details: Any) -> None:
        """Append `event` to `tenant`'s audit log (`runtime.audit`), with `details` and
        the tenant as its actor, after the writes queued so far; nobody waits for it."""
        self.write_later(self.store.add_audit,
                         AuditRow(tenant, time.time(), event, {"actor": tenant, **details}))

    # ------------------------------------------------------------------ models

    def base(self, name: str, field: str = "base_model") -> Served:
        """The served model `name` (a name or alias; empty: the first configured)."""
        return self.bases.get(name, field)

    def base_of(self, queue_id: str) -> Served:
        """The served model a queue's ops run on: a training model's or a sampling
        session's base (the first configured for any other queue)."""
        entry = self.models.get(queue_id) or self.samplers.get(queue_id)
        return self.bases.get(entry.base_model) if entry is not None else self.bases.default

    def start(self) -> None:
        """Start every model's worker."""
        for served in self.bases:
            served.scheduler.start()

    def stop(self, timeout: float) -> None:
        """Stop every model's worker after its queued ops, each within `timeout` s."""
        for served in self.bases:
            served.scheduler.stop(True, timeout)

    # ------------------------------------------------------------------ gauges

    def models_loaded(self) -> int:
        return len(self.models)

    # ------------------------------------------------------------------ auth

    def authenticate(self, token: str | None, while_draining: bool = False) -> str:
        """The tenant of an API key (`None`: none sent); every front calls this first.
        While the server drains, only calls `while_draining` (reading an op's outcome)
        are served."""
        if self.draining and not while_draining:
            raise Unavailable("the server is shutting down")
        if self.open_mode:
            return OPEN_TENANT
        row = self.store.active_key(token) if token else None
        if row is None:
            raise Unauthenticated("authorization: missing or invalid API key "
                                  "(send 'Bearer <key>')")
        return row.tenant

    def model_of(self, tenant: str, model_id: str) -> ModelEntry:
        entry = self.models.get(model_id)
        if entry is None or entry.tenant != tenant:
            raise NotFound(f"model_id: no model {model_id!r}")
        return entry

    def sampler_of(self, tenant: str, session_id: str) -> SamplerEntry:
        entry = self.samplers.get(session_id)
        if entry is None or entry.tenant != tenant:
            raise NotFound(f"sampling_session_id: no sampling session {session_id!r}")
        return entry

    def checkpoint(self, tenant: str, ref: CheckpointRef) -> tuple[CheckpointRow, Path]:
        """A checkpoint the tenant may read (its own, or one another tenant published)
        and its directory; any other looks like nothing."""
        return self._checkpoint(tenant, ref, include_public=True)

    def own_checkpoint(self, tenant: str, ref: CheckpointRef) -> tuple[CheckpointRow, Path]:
        """A checkpoint the tenant owns, to change or delete; another tenant's, even a
        published one, looks like nothing."""
        return self._checkpoint(tenant, ref, include_public=False)

    def _checkpoint(self, tenant: str, ref: CheckpointRef, include_public: bool
                    ) -> tuple[CheckpointRow, Path]:
        row = self.store.get_checkpoint(tenant, ref.run_id, ref.kind, ref.name,
                                        include_public=include_public)
        if row is None:
            raise NotFound(f"{ref.field}: no checkpoint {ref.text!r}")
        return row, self.store.checkpoint_root / row.rel_path

    def checkpoint_base(self, row: CheckpointRow, field: str = "path",
                        run: RunRow | None = None) -> Served:
        """The served model a checkpoint was trained on (its run's base: `run` when the
        caller has it, else read); one this server no longer serves is refused naming
        it."""
        run = run or self.store.get_run(row.tenant, row.run_id)
        name = run.base_model if run is not None else self.bases.default.name
        return self.bases.of_record(name, f"{field}: checkpoint "
                                          f"{paths.tinker_path(row.run_id, row.checkpoint_id)}")

    def check_same_base(self, row: CheckpointRow, served: Served, field: str = "path"
                        ) -> None:
        """Refuse loading a checkpoint into a model of another base, naming both."""
        trained = self.checkpoint_base(row, field)
        if trained is not served:
            raise FailedPrecondition(
                f"{field}: checkpoint {paths.tinker_path(row.run_id, row.checkpoint_id)} was trained "
                f"on base model {trained.name!r}; it cannot load into a model of "
                f"{served.name!r}")

    async def drop_checkpoint(self, row: CheckpointRow, expired_by: float | None = None
                              ) -> bool:
        """Delete a checkpoint's record, then its files, on the writer thread. With
        `expired_by`, only if it still expires by then: its owner may have changed the
        expiry or saved over it since the sweep read it. Returns whether it was deleted."""
        def drop() -> bool:
            if not self.store.delete_checkpoint(row, expired_by):
                return False
            shutil.rmtree(self.store.checkpoint_root / row.rel_path, ignore_errors=True)
            return True
        return await self.write(drop)

    # ------------------------------------------------------------------ ops

    async def run(self, op: Op, base: Served | None = None) -> Any:
        """Submit to the scheduler of the op's model (`base`, else its queue's:
        `base_of`) and await the result; failures raise. Every op of every front passes
        here, so this is where it is logged and observed.

        When the awaiting task is cancelled (the SDK's `cancel_future`, a gRPC client
        gone away), the scheduler is told nobody waits here any more: a sample op then
        leaves its queue or the decode pool; any other op runs on (`Scheduler.cancel`).
        """
        start, submitted = time.perf_counter(), time.monotonic()
        result = error = None
        session = self._alive(op.queue_id)
        if session:
            self.ops_in_flight.setdefault(session, []).append(op)
        sampler = self.samplers.get(op.queue_id)
        if sampler is not None:   # in use until it ends (`Lifetimes.expire_snapshots`)
            sampler.in_flight += 1
        served = base or self.base_of(op.queue_id)
        future = served.scheduler.submit(op)
        told = SUBMITTED.get()
        if told is not None and not told.done():
            refused = future.done() and isinstance(future.exception(), ResourceExhausted)
            told.set_result(future.exception() if refused else None)
        try:
            result = await asyncio.wrap_future(future)
            return result
        except asyncio.CancelledError:
            served.scheduler.cancel(future)
            error = Cancelled(f"{op.kind}: its caller stopped waiting")
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if sampler is not None:
                sampler.in_flight -= 1
                sampler.last_used = time.monotonic()
            if session:   # by identity: `==` on ops compares their numpy payloads
                ops = [o for o in self.ops_in_flight[session] if o is not op]
                if ops:
                    self.ops_in_flight[session] = ops
                else:
                    del self.ops_in_flight[session]
            self._alive(op.queue_id)
            seconds = time.perf_counter() - start
            log.info("op model=%s seq=%s op=%s tokens=%d ms=%.1f base=%s", op.queue_id,
                     op.seq_id, op.kind, op.tokens, seconds * 1000, served.name)
            self._trace(op, served, submitted, future, result, error)
            # A retried seq_id gets the first call's future: nothing ran again, so the
            # metrics count it once (the first call observes it).
            if self.observe_op is not None and getattr(future, "op", op) is op:
                self.observe_op(served.name, op, seconds, result, error)

    def _session_of(self, queue_id: str) -> str | None:
        """The client session of a model's or sampling session's queue (None: none)."""
        model, sampler = self.models.get(queue_id), self.samplers.get(queue_id)
        return model.session_id if model else sampler.session_id if sampler else None

    def session_busy(self, session_id: str) -> bool:
        """Whether one of the session's ops runs or waits only for the ops before it:
        unordered, or not ahead of its queue's next seq_id. An op ahead of a seq_id its
        client never sent waits on that client alone, and keeps nothing alive."""
        for op in self.ops_in_flight.get(session_id, ()):
            if op.seq_id is None:
                return True
            try:
                if op.seq_id <= self.base_of(op.queue_id).scheduler.next_seq(op.queue_id):
                    return True
            except UnknownQueue:
                continue
        return False

    def _alive(self, queue_id: str) -> str | None:
        """Mark the session of `queue_id` (returned; None: none) alive now."""
        if session := self._session_of(queue_id):
            self.last_op[session] = time.time()
        return session

    def _trace(self, op: Op, served: Served, submitted: float, future: Any, result: Any,
               error: BaseException | None) -> None:
        """Leave the ended `op` in its session's trace, if it belongs to a session."""
        session = self._session_of(op.queue_id)
        if not session:
            return
        outcome = "ok" if error is None else getattr(error, "category", "internal")
        pool = served.engine.decode_stats()
        args = {"seq_id": op.seq_id, "tokens": op.tokens, "bytes_in": op.bytes,
                "bytes_out": _bytes_out(result), "tenants_in_pass": getattr(future, "tenants", 0),
                "outcome": outcome, "base_model": served.name}
        if isinstance(result, Generation):
            args["decode_slices"] = result.decode_slices
        role = "model" if op.queue_id in self.models else "sampler"
        self.traces.op(
            session, f"{role} {op.queue_id}", op.kind, submitted,
            getattr(future, "started", None), time.monotonic(), args,
            {"queue depth": served.scheduler.stats()["queued"],
             "KV positions used": pool.kv_in_use,
             "adapter page-ins": served.engine.paging_stats().page_ins},
            {"decode tokens": pool.tokens_decoded})

    async def ordered(self, tenant: str, ref: OpRef, kind: str, fn: Callable[[], T]) -> T:
        """Run `fn` on the worker as op `ref.seq_id` of the tenant's model `ref.model_id`."""
        self.model_of(tenant, ref.model_id)
        self.write_later(self.store.touch_run, ref.model_id)
        return await self.run(Op(ref.model_id, ref.seq_id, kind, None, 0, fn, ref.request_id,
                                 tenant=tenant))

    def refuse(self, queue_id: str, seq_id: int | None, kind: str, error: Exception,
               request_id: str = "") -> Refusal:
        """Store `error` as the result of a request refused before it ran. It takes its
        seq_id before this returns, so it is consumed in order whether or not the caller
        waits, and the queue's later ops are not left waiting for it.

        Awaiting the `Refusal` waits for the op's turn and raises `error` (or gives what
        the seq_id already held: a retry's stored result). A front that must answer at
        once (HTTP: the SDK sends the first chunk of a parallel forward_backward only
        after the others are answered, so a refused later chunk must not wait for a
        chunk not yet sent) raises `Refusal.error` instead, without awaiting."""
        op = Op.failed(queue_id, seq_id, kind, error, request_id)
        now: BaseException = error
        if seq_id is not None:
            taken = self.base_of(queue_id).scheduler.submit(op)
            # The seq_id could not be taken (used by another op, too far ahead) or already
            # holds an outcome: that is the answer, not `error`.
            if taken.done() and taken.exception() not in (None, error):
                now = taken.exception()
        # The same op through `run`, so it is logged and observed like every op: for an
        # ordered op the scheduler answers it with `taken` itself (same seq_id, kind).
        outcome = asyncio.ensure_future(self.run(op))
        outcome.add_done_callback(_log_refusal)
        return Refusal(now, outcome)

    async def admin(self, kind: str, fn: Callable[[], T], base: Served | None = None) -> T:
        """Run an engine mutation (add/remove adapter) on the worker of `base` (default:
        the first served model)."""
        return await self.run(Op(ADMIN_QUEUE, None, kind, None, 0, fn),
                              base or self.bases.default)

    def new_model_id(self) -> str:
        return "run-" + secrets.token_hex(6)

    # ------------------------------------------------------------------ sweeps

    async def expire(self) -> None:
        """The periodic sweep (`server.serve`): what each verb group put in `sweeps`
        (idle sessions, checkpoints past their expiry and superseded snapshots:
        `runtime.lifetimes`; stale uploads). A failure is logged, not raised: the next
        sweep tries again."""
        for sweep in self.sweeps:
            try:
                await sweep()
            except Exception:
                log.exception("expiry sweep %s failed", sweep.__name__)


def bearer_token(authorization: str) -> str | None:
    """The key of an `authorization: Bearer <key>` header or gRPC metadata value; the
    scheme's name is read in any case (RFC 7235). None: another scheme, or no key."""
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip() or None


def _log_refusal(outcome: asyncio.Future) -> None:
    """A refusal nobody awaited still took its seq_id; its error went to the caller."""
    if not outcome.cancelled() and outcome.exception() is not None:
        log.debug("refused op took its seq_id: %s", outcome.exception())


def _log_write_failure(future) -> None:
    if future.exception() is not None:
        log.error("store write failed", exc_info=future.exception())


def _bytes_out(result: Any) -> int:
    """Bytes of an op's arrays coming back: a forward's logprobs, a sample's tokens and
    logprobs (0 for anything else)."""
    if isinstance(result, ForwardOutput):
        return sum(lp.nbytes for lp in result.logprobs)
    if isinstance(result, Generation):
        return sum(s.tokens.nbytes + s.logprobs.nbytes for s in result.sequences)
    return 0
