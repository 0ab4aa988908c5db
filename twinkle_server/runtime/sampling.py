"""Sampling verbs: sampling sessions over a sampler checkpoint, the base or a live model,
sampling and prompt logprobs.

A request names either a live model's op (`OpRef`: ordered after that model's training
ops) or a sampling session (unordered, in arrival order on the session's queue).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from twinkle_server.engine.engine import SampleRequest
from twinkle_server.engine.errors import EngineError, InvalidArgument
from twinkle_server.engine.sampler import check_topk
from twinkle_server.engine.types import SampledSequence, SamplingParams
from twinkle_server.executor import SAMPLE
from twinkle_server.runtime.core import CheckpointRef, Core, OpRef, SamplerEntry
from twinkle_server.scheduler import Op


@dataclass(frozen=True)
class Target:
    """Where a sample or logprobs request runs: its queue and seq, and what it routes to."""

    queue: str
    seq_id: int | None
    request_id: str
    adapter_id: str | None
    weights_path: str | None


@dataclass(frozen=True)
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: Any | None   # an engine `PromptLogprobs` when asked for


class Sampling:
    def __init__(self, core: Core) -> None:
        self.core = core

    async def create_session(self, tenant: str, session_id: str = "", *,
                             model_path: CheckpointRef | None = None, base_model: str = "",
                             model_id: str = "") -> str:
        """A sampling session on exactly one of a sampler checkpoint, the base model or a
        live model; returns its id."""
        core = self.core
        if sum((model_path is not None, bool(base_model), bool(model_id))) != 1:
            raise InvalidArgument("model_path, base_model, model_id: give exactly one")
        weights = None
        if model_path is not None:
            _, source = core.checkpoint(tenant, model_path)
            weights = str(source)
        elif model_id:
            core.model_of(tenant, model_id)
        else:
            core.check_base_model(base_model)
        sampling_id = "samp-" + secrets.token_hex(6)
        core.samplers[sampling_id] = SamplerEntry(session_id, tenant, model_id or None,
                                                  weights, core.config.model)
        core.scheduler.register_model(sampling_id)
        return sampling_id

    def target(self, tenant: str, op: OpRef | None, sampling_session_id: str = "",
               request_id: str = "") -> Target:
        """A live model's op when `op` is given, else the sampling session's queue."""
        if op is not None:
            self.core.model_of(tenant, op.model_id)
            return Target(op.model_id, op.seq_id, op.request_id or request_id, op.model_id,
                          None)
        entry = self.core.sampler_of(tenant, sampling_session_id)
        return Target(sampling_session_id, None, request_id, entry.model_id,
                      entry.weights_path)

    async def refuse(self, target: Target, kind: str, error: Exception) -> Any:
        """Store a refusal as the target op's result (see `Core.refuse`); raises it."""
        return await self.core.refuse(target.queue, target.seq_id, kind, error,
                                      target.request_id)

    async def sample(self, target: Target, prompt: np.ndarray, num_samples: int,
                     params: SamplingParams, include_prompt_logprobs: bool = False,
                     topk_prompt_logprobs: int = 0) -> SampleResult:
        """`num_samples` completions of `prompt`; `params.max_tokens` 0 means up to the
        context limit. With `include_prompt_logprobs` or `topk_prompt_logprobs` > 0, the
        prompt's own logprobs (and top-k) come too."""
        core = self.core
        try:
            check_topk(topk_prompt_logprobs)  # before sampling, not after it
        except EngineError as exc:
            return await self.refuse(target, "sample", exc)
        if not params.max_tokens:
            params = replace(params, max_tokens=max(1, core.config.max_seq_len - prompt.size))
        payload = SampleRequest(target.adapter_id, target.weights_path, prompt,
                                num_samples or 1, params)
        sequences = await core.run(Op(target.queue, target.seq_id, "sample", SAMPLE,
                                      payload.num_tokens, payload, target.request_id))
        scored = None
        if include_prompt_logprobs or topk_prompt_logprobs:
            scored = await core.run(Op(
                target.queue, None, "prompt_logprobs", None, prompt.size,
                lambda: core.engine.prompt_logprobs(target.adapter_id, target.weights_path,
                                                    prompt, topk_prompt_logprobs)))
        return SampleResult(sequences, scored)

    async def compute_logprobs(self, target: Target, prompt: np.ndarray) -> np.ndarray:
        """The logprob of each prompt token given the ones before it (NaN at 0)."""
        engine = self.core.engine
        return await self.core.run(Op(
            target.queue, target.seq_id, "compute_logprobs", None, prompt.size,
            lambda: engine.compute_logprobs(target.adapter_id, target.weights_path, prompt),
            target.request_id))
