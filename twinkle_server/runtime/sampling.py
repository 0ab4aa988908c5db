"""Sampling verbs: sampling sessions over a sampler checkpoint, the base or a live model,
sampling and prompt logprobs.

A request names either a live model's op (`OpRef`: ordered after that model's training
ops) or a sampling session (unordered, in arrival order on the session's queue).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from twinkle_server.engine import PromptScoring, checks
from twinkle_server.engine.errors import (
    EngineError,
    FailedPrecondition,
    InvalidArgument,
)
from twinkle_server.engine.types import (
    Progress,
    SampledSequence,
    SampleRequest,
    SamplingParams,
)
from twinkle_server.runtime import audit
from twinkle_server.runtime.bases import ONCE_QUEUE, Served
from twinkle_server.runtime.core import Core
from twinkle_server.runtime.lifetimes import Lifetimes
from twinkle_server.runtime.values import CheckpointRef, OpRef, Refusal, SamplerEntry
from twinkle_server.scheduling.executor import SAMPLE
from twinkle_server.scheduling.planning import Op


@dataclass(frozen=True)
class Target:
    """Where a sample or logprobs request runs: its queue and seq, and what it routes to."""

    queue: str
    seq_id: int | None
    request_id: str
    adapter_id: str | None
    weights_path: str | None
    cache_namespace: str = ""     # a sampling session's: its prompts share prefix KV
    tenant: str | None = None       # whose request: its ops count against their bounds


def context_left(served: Served, prompt_tokens: int) -> int:
    """What `max_tokens` 0 (or left out) means for a prompt of `prompt_tokens`: up to
    the model's context limit, at least one."""
    return max(1, served.model.max_seq_len - prompt_tokens)


@dataclass(frozen=True)
class Source:
    """What a sample without a session reads: a served base, and a sampler checkpoint's
    weights on it (None: the base alone)."""

    served: Served
    weights_path: str | None = None
    tenant: str | None = None       # whose request: its ops count against their bounds


@dataclass(frozen=True)
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: Any | None   # an engine `PromptLogprobs` when asked for
    prompt_cache_hit_tokens: int = 0


def check_sample(request: SampleRequest, scoring: PromptScoring, served: Served) -> None:
    """Every rule of a sample request against `served`'s limits and vocabulary, each the
    engine's own (`engine.checks`), run once before the request is queued.

    Raises:
        InvalidArgument: naming the field and its limit.
    """
    limits, vocab = served.engine.limits, served.engine.base.vocab_size
    checks.prompt(np.asarray(request.prompt), limits, vocab)
    checks.sampling(request)
    checks.sample_size(request, limits)
    checks.prompt_scoring(scoring, request.prompt.size, vocab)


def _checked(served: Served, target: Target, prompt: np.ndarray, num_samples: int,
             params: SamplingParams, include_prompt_logprobs: bool,
             topk_prompt_logprobs: int, topk_sample_logprobs: int,
             prompt_options: PromptScoring | None) -> tuple[SampleRequest, PromptScoring]:
    """A sample request to `target` as the engine takes it, and its prompt scoring,
    checked (`check_sample`); `params.max_tokens` 0 becomes the context left."""
    scoring = replace(prompt_options or PromptScoring(), include=include_prompt_logprobs,
                      topk=topk_prompt_logprobs, temperature=params.temperature,
                      seed=params.seed)
    if not params.max_tokens:
        params = replace(params, max_tokens=context_left(served, prompt.size))
    payload = SampleRequest(target.adapter_id, target.weights_path, prompt, num_samples,
                            params, topk_sample_logprobs, target.cache_namespace)
    check_sample(payload, scoring, served)
    return payload, scoring


class Sampling:
    def __init__(self, core: Core, lifetimes: Lifetimes) -> None:
        self.core = core
        self.lifetimes = lifetimes

    async def create_session(self, tenant: str, session_id: str = "", *,
                             model_path: CheckpointRef | None = None, base_model: str = "",
                             model_id: str = "") -> str:
        """A sampling session on exactly one of a sampler checkpoint, a base model or a
        live model; returns its id. It runs on the base model the checkpoint or live
        model was trained on; `base_model` given beside `model_path` must name that base."""
        core = self.core
        if sum((model_path is not None, bool(model_id))) > 1 or not (
                model_path is not None or base_model or model_id):
            raise InvalidArgument("model_path, base_model, model_id: give exactly one "
                                  "(base_model may come with model_path, naming its base)")
        if model_id and base_model:
            raise InvalidArgument("model_id, base_model: give one; a live model samples "
                                  "on its own base")
        weights = None
        if model_path is not None:
            source = self.source(tenant, model_path, base_model)
            served, base_name, weights = source.served, source.served.name, source.weights_path
        elif model_id:
            entry = core.model_of(tenant, model_id)
            served, base_name = core.base_of(model_id), entry.base_model
        else:
            served, base_name = core.base(base_model), base_model
        sampling_id = "samp-" + secrets.token_hex(6)
        core.samplers[sampling_id] = SamplerEntry(
            session_id, tenant, model_id or None, weights, base_name,
            last_used=time.monotonic(),
            model_path=model_path.text if model_path is not None else None)
        served.scheduler.register_model(sampling_id)
        core.record(tenant, "sampler_create", sampling_session_id=sampling_id,
                    session_id=session_id or None,
                    model_path=model_path.text if model_path is not None else None,
                    base_model=base_model or None, live_model_id=model_id or None)
        return sampling_id

    async def snapshot(self, tenant: str, op: OpRef, inflight: bool = False) -> str:
        """Tinker's `save_weights_and_get_sampling_client`: the model's weights after its
        ops before `op`, saved as op `op.seq_id` for a new sampling session of their own
        in the model's session; returns the sampling session's id.

        The SDK calls these weights ephemeral: they are no checkpoint (never listed, no
        path, nothing counted against the tenant) and are deleted with their sampling
        session: when its client session closes or expires, when a newer snapshot of the
        model replaced them and they were unused for `--session-timeout` seconds (never
        the model's first or newest snapshot in the session: `Lifetimes.expire_snapshots`),
        and at a restart.

        `inflight` (Tinker's `kind="inflight"`) publishes them instead to the model's one
        mutable inflight target (`Engine.publish_inflight`), shared by all its inflight
        sessions, this new one included: rows they are decoding take the new weights at
        their next token. Each session is its own prefix-cache namespace."""
        core, model_id = self.core, op.model_id
        model = core.model_of(tenant, op.model_id)
        owner = model.session_id or ""
        served = core.base_of(model_id)
        engine = served.engine
        sampling_id = "samp-" + secrets.token_hex(6)
        if inflight:
            route = await core.ordered(tenant, op, "save_sampler",
                                       lambda: engine.publish_inflight(model_id))
            entry = SamplerEntry(owner, tenant, route, None, model.base_model,
                                 last_used=time.monotonic(), inflight_of=model_id)
        else:
            target = core.snapshot_root / sampling_id
            await core.ordered(tenant, op, "save_sampler",
                               lambda: engine.save_weights(model_id, target))
            entry = SamplerEntry(owner, tenant, None, str(target), model.base_model,
                                 snapshot=True, snapshot_of=model_id,
                                 last_used=time.monotonic())
        core.samplers[sampling_id] = entry
        served.scheduler.register_model(sampling_id)
        source = "inflight_of" if inflight else "snapshot_of"
        core.record(tenant, "sampler_create", sampling_session_id=sampling_id,
                    session_id=owner or None, **{source: model_id})
        if owner and core.store.session_tenant(owner) is None:
            # Closed while the save ran: `Lifetimes.close_session_models` has passed by.
            await self.lifetimes.end_sampler(sampling_id, "session closed")
            raise FailedPrecondition(f"session_id: session {owner!r} was closed")
        return sampling_id

    def target(self, tenant: str, op: OpRef | None, sampling_session_id: str = "",
               request_id: str = "") -> Target:
        """A live model's op when `op` is given, else the sampling session's queue."""
        if op is not None:
            self.core.model_of(tenant, op.model_id)
            return Target(op.model_id, op.seq_id, op.request_id or request_id, op.model_id,
                          None, tenant=tenant)
        entry = self.core.sampler_of(tenant, sampling_session_id)
        entry.last_used = time.monotonic()
        return Target(sampling_session_id, None, request_id, entry.model_id,
                      entry.weights_path, sampling_session_id, tenant)

    def refuse(self, target: Target, kind: str, error: Exception) -> Refusal:
        """Take the target op's seq_id with `error` as its result (`Core.refuse`); await
        it for the op's outcome in its turn, or answer `Refusal.error` at once."""
        return self.core.refuse(target.queue, target.seq_id, kind, error, target.request_id)

    def source(self, tenant: str, model_path: CheckpointRef | None = None,
               base_model: str = "") -> Source:
        """The base and weights a sampler checkpoint `model_path` (readable by `tenant`)
        or a base model `base_model` names; the checkpoint's read is audited. Given
        beside `model_path`, `base_model` must name the base it was trained on."""
        core = self.core
        if model_path is None:
            return Source(core.base(base_model), tenant=tenant)
        row, path = core.checkpoint(tenant, model_path)
        served = core.checkpoint_base(row, model_path.field)
        if base_model and core.base(base_model) is not served:
            raise InvalidArgument(
                f"base_model: {base_model!r}, but {model_path.field} "
                f"{model_path.text!r} was trained on {served.name!r}; give that base, or none")
        audit.record(core, tenant, "checkpoint_read", purpose="sample",
                     **audit.checkpoint_details(row))
        return Source(served, str(path), tenant)

    def sample(self, target: Target, prompt: np.ndarray, num_samples: int,
               params: SamplingParams, include_prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0, *, topk_sample_logprobs: int = 0,
               prompt_options: PromptScoring | None = None) -> Awaitable[SampleResult]:
        """`num_samples` completions of `prompt`, to await; `params.max_tokens` 0 means up
        to the context limit. With `include_prompt_logprobs` or `topk_prompt_logprobs` > 0,
        the prompt's own logprobs (and top-k) come too; `topk_sample_logprobs` k > 0 gives
        each sampled position's top-k; `prompt_options` (its `last_n`, `targets`, `alt_k`)
        asks the rest of `PromptScoring`, at the request's temperature and seed.

        Every rule of the request is checked here, once, before anything is queued.

        Raises:
            InvalidArgument: at once, naming the field and its limit; an ordered op's
                seq_id is taken all the same (`refuse`).
        """
        served = self.core.base_of(target.queue)
        try:
            payload, scoring = _checked(served, target, prompt, num_samples, params,
                                        include_prompt_logprobs, topk_prompt_logprobs,
                                        topk_sample_logprobs, prompt_options)
        except EngineError as exc:
            raise self.refuse(target, "sample", exc).error from None
        return self._sample(target, payload, scoring, served)

    def sample_from(self, source: Source, prompt: np.ndarray, num_samples: int,
                    params: SamplingParams, *, include_prompt_logprobs: bool = False,
                    topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
                    prompt_options: PromptScoring | None = None,
                    on_progress: Callable[[Progress], None] | None = None
                    ) -> Awaitable[SampleResult]:
        """`sample` without a sampling session: `num_samples` completions of `prompt` on
        `source` (the OpenAI route's one request, and `asample` by `model_path` or
        `base_model`), with `sample`'s options. It runs in the same decode pool, on the
        model's standing queue for such samples (`ONCE_QUEUE`), shares no cached prefix
        and leaves nothing behind (no session, queue or audit row). `on_progress` hears
        its rows' tokens so far after each decode slice it is still decoding in (from the
        scheduler's worker thread; the static sampler reports none).

        Raises:
            InvalidArgument: at once, naming the field and its limit.
        """
        target = Target(ONCE_QUEUE, None, "", None, source.weights_path,
                        tenant=source.tenant)
        payload, scoring = _checked(source.served, target, prompt, num_samples, params,
                                    include_prompt_logprobs, topk_prompt_logprobs,
                                    topk_sample_logprobs, prompt_options)
        if on_progress is not None:
            payload = replace(payload, stream=True)
        return self._sample(target, payload, scoring, source.served, on_progress)

    async def _sample(self, target: Target, payload: SampleRequest, scoring: PromptScoring,
                      served: Served, on_progress: Callable[[Progress], None] | None = None
                      ) -> SampleResult:
        core, prompt = self.core, payload.prompt
        generation = await core.run(Op(target.queue, target.seq_id, "sample", SAMPLE,
                                       payload.num_tokens, payload, target.request_id,
                                       on_progress, target.tenant, prompt.nbytes), served)
        scored = None
        if scoring.wanted:
            scored = await core.run(Op(
                target.queue, None, "prompt_logprobs", None, prompt.size,
                lambda: served.engine.score_prompt(target.adapter_id, target.weights_path,
                                                 prompt, scoring),
                tenant=target.tenant, bytes=prompt.nbytes), served)
        return SampleResult(generation.sequences, scored, generation.prompt_cache_hit_tokens)

    async def compute_logprobs(self, target: Target, prompt: np.ndarray,
                               last_n: int | None = None) -> np.ndarray:
        """The logprob of each prompt token given the ones before it (NaN at 0); with
        `last_n`, of the last `last_n` tokens only (NaN before them)."""
        engine = self.core.base_of(target.queue).engine
        scoring = PromptScoring(include=True, last_n=last_n)
        try:
            checks.prompt(prompt, engine.limits, engine.base.vocab_size)
            checks.prompt_scoring(scoring, prompt.size)
        except EngineError as exc:
            return await self.refuse(target, "compute_logprobs", exc)
        return await self.core.run(Op(
            target.queue, target.seq_id, "compute_logprobs", None, prompt.size,
            lambda: engine.score_prompt(target.adapter_id, target.weights_path, prompt,
                                        scoring).logprobs,
            target.request_id, tenant=target.tenant, bytes=prompt.nbytes))
