"""Training verbs: models (one adapter each) and every op of a training loop.

Each verb takes an authenticated tenant and plain values, runs through the scheduler in
the model's seq order, and returns plain values or raises the one error family
(`twinkle_server.engine.errors`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_server.engine import checks
from twinkle_server.engine.errors import (
    EngineError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from twinkle_server.engine.types import (
    AdamParams,
    Datum,
    ForwardOutput,
    ForwardRequest,
    LoraSpec,
    LossSpec,
)
from twinkle_server.runtime import audit
from twinkle_server.runtime.core import Core
from twinkle_server.runtime.lifetimes import Lifetimes
from twinkle_server.runtime.stability import LOSS as STABLE_REINFORCE
from twinkle_server.runtime.stability import Stability
from twinkle_server.runtime.values import CheckpointRef, ModelEntry, OpRef, Refusal, check_metadata
from twinkle_server.scheduling.executor import FORWARD
from twinkle_server.scheduling.planning import Op
from twinkle_server.store import CheckpointRow
from twinkle_wire import Provenance


@dataclass(frozen=True)
class ModelInfo:
    """What a front reports about a loaded model."""

    entry: ModelEntry
    arch: str
    spec: LoraSpec
    next_seq_id: int
    target_modules: list[str]
    trainable_params: int
    state_bytes: int
    tokenizer_id: str


def spec_to_json(spec: LoraSpec) -> dict[str, Any]:
    targets = spec.target_modules
    return {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout,
            "target_modules": targets if isinstance(targets, str) else list(targets),
            "use_rslora": spec.use_rslora, "seed": spec.seed}


class Training:
    def __init__(self, core: Core, lifetimes: Lifetimes) -> None:
        self.core = core
        self.lifetimes = lifetimes
        self.stability = Stability(core)

    # ------------------------------------------------------------------ models

    def info(self, tenant: str, model_id: str) -> ModelInfo:
        core = self.core
        entry = core.model_of(tenant, model_id)
        served = core.base_of(model_id)
        info = served.engine.adapter_info(model_id)
        return ModelInfo(entry, served.engine.base.arch, info["spec"],
                         served.scheduler.next_seq(model_id), info["target_modules"],
                         info["trainable_params"], info["state_bytes"],
                         served.tokenizer_id)

    async def create_model(self, tenant: str, *, spec: LoraSpec | None,
                           from_checkpoint: CheckpointRef | None = None,
                           load_optimizer: bool = False, session_id: str | None = None,
                           base_model: str = "", user_metadata: Mapping[str, str] = {},
                           gradient_accumulation_steps: int = 0) -> ModelInfo:
        """A new adapter (a training run) on base model `base_model` (empty: the first
        served) from `spec`, or from a saved checkpoint of that base.

        `gradient_accumulation_steps` 0 means 1, or the checkpoint's count when loading
        its optimizer.
        """
        core = self.core
        if spec is not None and not spec.target_modules:
            raise InvalidArgument("lora: train_mlp, train_attn and train_unembed are all "
                                  "false; the adapter would train nothing")
        if session_id and core.store.session_tenant(session_id) != tenant:
            raise NotFound(f"session_id: no session {session_id!r}")
        metadata = check_metadata(user_metadata, "user_metadata")
        source: Path | None = None
        if from_checkpoint is not None:
            row, source = core.checkpoint(tenant, from_checkpoint)
            served = core.checkpoint_base(row, from_checkpoint.field)
            if base_model:
                core.check_same_base(row, core.base(base_model), from_checkpoint.field)
        else:
            served = core.base(base_model)
        served.check_trains()
        base_name = base_model or served.name
        owned = sum(1 for e in core.models.values() if e.tenant == tenant)
        if owned >= core.config.max_adapters_per_tenant:
            raise ResourceExhausted(
                f"adapters: tenant already has {owned} adapters loaded, the per-tenant limit "
                f"(--max-adapters-per-tenant {core.config.max_adapters_per_tenant}); "
                "unload one first")
        if source is not None:
            spec = served.engine.read_checkpoint_spec(source)
        if spec is None:
            raise InvalidArgument("lora: give a LoRA config or from_checkpoint")
        accum = gradient_accumulation_steps or 1
        model_id = core.new_model_id()

        engine = served.engine

        def create() -> None:
            engine.add_adapter(model_id, spec, gradient_accumulation_steps=accum,
                               owner=tenant)
            if source is not None:
                try:
                    engine.load_state(model_id, source, include_optimizer=load_optimizer,
                                      adopt_accumulation=not gradient_accumulation_steps)
                except EngineError:
                    engine.remove_adapter(model_id)
                    raise
        await core.admin("create_model", create, served)
        core.models[model_id] = ModelEntry(model_id, tenant, session_id or None, base_name)
        served.scheduler.register_model(model_id)
        await core.write(core.store.create_run, model_id, tenant, base_name,
                         spec_to_json(engine.adapters[model_id].spec), metadata,
                         session_id or None)
        audit.record(core, tenant, "model_create", model_id=model_id, base_model=base_name,
                     session_id=session_id or None,
                     from_checkpoint=from_checkpoint.text if from_checkpoint else None)
        if from_checkpoint is not None:
            row, _ = core.checkpoint(tenant, from_checkpoint)
            audit.record(core, tenant, "checkpoint_read", purpose="load", into=model_id,
                         **audit.checkpoint_details(row))
        return self.info(tenant, model_id)

    async def unload_model(self, tenant: str, model_id: str) -> None:
        self.core.model_of(tenant, model_id)
        await self.lifetimes.unload(model_id, "unloaded by its owner")   # records model_unload

    # ------------------------------------------------------------------ forward

    def forward_request(self, tenant: str, model_id: str, datums: Sequence[Datum],
                        loss: LossSpec | None, backward: bool,
                        provenance: Sequence[Provenance | None] | None = None
                        ) -> ForwardRequest:
        """The engine request, after the checks that need no adapter state (the model's
        ownership, shapes, limits, vocabulary), so a bad batch fails before it queues.
        For stable_reinforce, each datum's `provenance` is resolved against the sampler's
        records first (`runtime.stability`); other losses ignore provenance."""
        self.core.model_of(tenant, model_id)
        used: list[str] = []
        if loss is not None and loss.name == STABLE_REINFORCE:
            datums, used = self.stability.resolve(tenant, model_id, datums, provenance)
        request = ForwardRequest(model_id, datums, loss, backward)
        self.core.base_of(model_id).engine.check_forward(request)
        self.stability.touch(tenant, used)
        return request

    def check_tokens(self, model_id: str, total: int) -> None:
        """A running count of a batch's tokens within its model's `max_batch_tokens`
        (`engine.checks.batch_tokens`): a front calls it as it decodes, so a batch far over
        the limit is refused before all of it is held."""
        checks.batch_tokens(total, self.core.base_of(model_id).engine.limits)

    async def forward(self, tenant: str, ref: OpRef, request: ForwardRequest) -> ForwardOutput:
        """Forward (or forward_backward, by `request.backward`) as op `ref.seq_id`,
        merged with other models' passes; the adapter's own checks run in the op."""
        core = self.core
        core.model_of(tenant, ref.model_id)
        core.write_later(core.store.touch_run, ref.model_id)
        kind = "forward_backward" if request.backward else "forward"
        return await core.run(Op(ref.model_id, ref.seq_id, kind, FORWARD, request.num_tokens,
                                 request, ref.request_id, tenant=tenant,
                                 bytes=request.num_bytes, adapter=request.adapter_id))

    def refuse(self, tenant: str, ref: OpRef, kind: str, error: Exception) -> Refusal:
        """Take op `ref.seq_id` of the tenant's model with `error` as its result, before
        this returns (`Core.refuse`): await it for the op's outcome in its turn, or answer
        `Refusal.error` at once. Another tenant's model looks like no model (`NotFound`)."""
        self.core.model_of(tenant, ref.model_id)
        return self.core.refuse(ref.model_id, ref.seq_id, kind, error, ref.request_id)

    # ------------------------------------------------------------------ optimizer and loop

    async def optim_step(self, tenant: str, ref: OpRef, adam: AdamParams) -> dict[str, float]:
        engine, mid = self.core.base_of(ref.model_id).engine, ref.model_id
        return await self.core.ordered(tenant, ref, "optim_step",
                                       lambda: engine.optim_step(mid, adam))

    async def set_optimizer(self, tenant: str, ref: OpRef, name: str,
                            kwargs: dict[str, Any]) -> None:
        engine, mid = self.core.base_of(ref.model_id).engine, ref.model_id
        await self.core.ordered(tenant, ref, "set_optimizer",
                                lambda: engine.set_optimizer(mid, name, kwargs))

    async def set_lr_scheduler(self, tenant: str, ref: OpRef, name: str,
                               kwargs: dict[str, Any]) -> None:
        engine, mid = self.core.base_of(ref.model_id).engine, ref.model_id
        await self.core.ordered(tenant, ref, "set_lr_scheduler",
                                lambda: engine.set_lr_scheduler(mid, name, kwargs))

    async def set_loss(self, tenant: str, ref: OpRef, loss: LossSpec) -> None:
        engine, mid = self.core.base_of(ref.model_id).engine, ref.model_id
        await self.core.ordered(tenant, ref, "set_loss", lambda: engine.set_loss(mid, loss))

    async def clip_grad_norm(self, tenant: str, ref: OpRef, max_norm: float) -> float:
        engine, mid = self.core.base_of(ref.model_id).engine, ref.model_id
        return await self.core.ordered(tenant, ref, "clip_grad_norm",
                                       lambda: engine.clip_grad_norm(mid, max_norm))

    async def step(self, tenant: str, ref: OpRef) -> dict[str, float]:
        engine, mid = self.core.base_of(ref.model_id).engine, ref.model_id
        return await self.core.ordered(tenant, ref, "step", lambda: engine.step(mid))

    async def zero_grad(self, tenant: str, ref: OpRef) -> None:
        engine, mid = self.core.base_of(ref.model_id).engine, ref.model_id
        await self.core.ordered(tenant, ref, "zero_grad", lambda: engine.zero_grad(mid))

    async def lr_step(self, tenant: str, ref: OpRef) -> None:
        engine, mid = self.core.base_of(ref.model_id).engine, ref.model_id
        await self.core.ordered(tenant, ref, "lr_step", lambda: engine.lr_step(mid))

    async def calculate_metric(self, tenant: str, ref: OpRef,
                               is_training: bool) -> dict[str, float]:
        engine, mid = self.core.base_of(ref.model_id).engine, ref.model_id
        return await self.core.ordered(tenant, ref, "calculate_metric",
                                       lambda: engine.calculate_metric(mid, is_training))

    async def get_train_configs(self, tenant: str, ref: OpRef) -> dict[str, Any]:
        engine, mid = self.core.base_of(ref.model_id).engine, ref.model_id
        return await self.core.ordered(tenant, ref, "get_train_configs",
                                       lambda: engine.get_train_configs(mid))

    async def skip_seq(self, tenant: str, ref: OpRef) -> None:
        """Spend a seq_id the client reserved and will send no op under."""
        await self.core.ordered(tenant, ref, "skip_seq", lambda: None)

    # ------------------------------------------------------------------ checkpoints

    async def save(self, tenant: str, ref: OpRef, kind: str, name: str, *,
                   include_optimizer: bool = False, overwrite: bool = False,
                   user_metadata: Mapping[str, str] = {}) -> CheckpointRow:
        """Save a training checkpoint (`kind` 'training', optionally with the optimizer)
        or sampler weights ('sampler'); `name` must already be a valid checkpoint name."""
        core, mid = self.core, ref.model_id
        with_optimizer = kind == "training" and include_optimizer
        core.model_of(tenant, mid)
        try:
            metadata = check_metadata(user_metadata, "user_metadata")
        except EngineError as exc:
            return await self.refuse(tenant, ref, f"save_{kind}", exc)
        target = core.store.checkpoint_dir(tenant, mid, kind, name)
        engine = core.base_of(mid).engine

        def save() -> CheckpointRow:
            if kind == "sampler":
                size = engine.save_weights(mid, target, overwrite=overwrite)
            else:
                size = engine.save_state(mid, target, include_optimizer=with_optimizer,
                                              overwrite=overwrite)
            # Recorded inside the op, so the model's next op (a pipelined load of this
            # name) finds it.
            row = CheckpointRow(mid, kind, name, tenant,
                                str(target.relative_to(core.store.checkpoint_root)), size,
                                with_optimizer, time.time(), metadata)
            core.store.add_checkpoint(row)
            audit.record(core, tenant, "checkpoint_save", **audit.checkpoint_details(row))
            return row

        return await core.ordered(tenant, ref, f"save_{kind}", save)

    async def load(self, tenant: str, ref: OpRef, source: CheckpointRef,
                   include_optimizer: bool) -> None:
        core, mid = self.core, ref.model_id
        served = core.base_of(mid)

        def load() -> None:
            # Resolved in the op: a save queued before this load has recorded its path.
            row, directory = core.checkpoint(tenant, source)
            core.check_same_base(row, served, source.field)
            served.engine.load_state(mid, directory, include_optimizer)
            audit.record(core, tenant, "checkpoint_read", purpose="load", into=mid,
                         **audit.checkpoint_details(row))

        await core.ordered(tenant, ref, "load_state", load)
