"""The engine's sampling half: sampler checkpoints kept loaded, inflight targets, the
decode pool (continuous batching, `engine.decoding`), the static batch and prompt scoring.

`EngineSampling` is a part of `engine.Engine`, split out by job: it holds the sampling
state (`_init_sampling`) and reads the adapters, layers and ranks the engine owns.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from twinkle_server.engine import checkpoint, checks, memory
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.decoding import DecodePool, PoolStats
from twinkle_server.engine.errors import EngineError
from twinkle_server.engine.lora import adapter_order
from twinkle_server.engine.memory import OUT_OF_MEMORY
from twinkle_server.engine.protocol import rank_zero_only, replicated
from twinkle_server.engine.sampler_cache import SamplerCache
from twinkle_server.engine.types import Generation, LoraSpec, SampledSequence, SampleRequest

if TYPE_CHECKING:
    from twinkle_server.engine.engine import Engine

log = logging.getLogger(__name__)


def inflight_key(adapter_id: str) -> str:
    """The routing id of a model's inflight target (`Engine.publish_inflight`)."""
    return f"inflight:{adapter_id}"


class EngineSampling:
    """Sampling verbs of `Engine`; see the module docstring."""

    def _init_sampling(self: Engine) -> None:
        """Sampler checkpoint cache, inflight targets and the decode pool, once the base
        and the limits are settled."""
        self.samplers = SamplerCache(self._load_sampler,
                                     lambda key, adapter: self._detach(key, adapter.weights),
                                     pinned=lambda: self.pool.routes())
        # Inflight targets by routing id (`publish_inflight`), and how often each was
        # published: the weights version its sessions' prefix cache is keyed by.
        self.inflight: dict[str, Adapter] = {}
        self.inflight_versions: dict[str, int] = {}
        limits = self.limits
        if not limits.kv_pool_tokens:
            self.limits = limits = replace(limits, kv_pool_tokens=memory.auto_kv_pool_tokens(
                self.base.config, self.base.dtype, self._free_bytes()))
            log.info("the sampler's KV pool holds %d positions (--kv-pool-tokens)",
                     limits.kv_pool_tokens)
        base = self.base
        self.pool = DecodePool(base.model, self.router.route, eos_token_ids=base.eos_token_ids,
                               pad_token_id=base.pad_token_id, decode=base.decode,
                               capacity=limits.kv_pool_tokens, prefill_tokens=self.pass_tokens,
                               parallel=self.parallel)

    @rank_zero_only
    def has_sampler(self: Engine, weights_path: str | os.PathLike) -> bool:
        """Whether the sampler checkpoint at `weights_path`, as its files are now, is
        loaded (cached)."""
        return weights_path in self.samplers

    @rank_zero_only
    def sampler_dirs(self: Engine) -> set[str]:
        """The directories (real paths) of the sampler checkpoints loaded now."""
        return self.samplers.dirs()

    def _sampling_adapter(self: Engine, adapter_id: str | None, weights_path: str | None) -> str | None:
        """The adapter id to route for a request, loading a sampler checkpoint if needed."""
        if adapter_id is not None:
            if adapter_id not in self.inflight:
                self._adapter(adapter_id)
            return adapter_id
        return None if weights_path is None else self.samplers.route(weights_path)

    def _frozen(self: Engine, key: str, spec: LoraSpec) -> Adapter:
        """A frozen adapter of `spec`'s shape routed as `key`, to copy weights into."""
        adapter = Adapter(key, spec, self._new_weights(LoraSpec(**{**asdict(spec), "seed": 0}),
                                                       self._targets(spec)))
        for param in adapter.parameters():
            param.requires_grad_(False)
        return adapter

    @replicated
    def publish_inflight(self: Engine, adapter_id: str) -> str:
        """Copy the adapter's weights into its inflight target (made on first use) and
        return the target's routing id: what Tinker's inflight sampling clients share.
        Rows decoding from it take the new weights at their next step."""
        source = self._adapter(adapter_id)
        key = inflight_key(adapter_id)
        if key not in self.inflight:
            self.inflight[key] = self._frozen(key, source.spec)
            self._attach(self.inflight[key])
        checkpoint.copy_weights(self.inflight[key], checkpoint.peft_tensors(source))
        self.inflight_versions[key] = self.inflight_versions.get(key, 0) + 1
        return key

    def _namespace(self: Engine, request: SampleRequest, route_id: str | None
                   ) -> tuple[str, str] | None:
        """The prefix-cache namespace of a request: its session and its weights' version
        (a checkpoint's key, the base, or an inflight publication); none for a live
        adapter, whose weights change under it with every step."""
        if not request.cache_namespace:
            return None
        if route_id in self.inflight:
            version = f"{route_id}#{self.inflight_versions[route_id]}"
        elif route_id is not None and route_id in self.adapters:
            return None
        else:
            version = route_id or "base"
        return request.cache_namespace, version

    def _load_sampler(self: Engine, key: str, weights_path: str) -> Adapter:
        """The sampler checkpoint at `weights_path` as a frozen adapter routed as `key`,
        attached to the base once its weights are checked."""
        spec, _ = checkpoint.read_spec(weights_path)
        found = checkpoint.read_weights(weights_path)
        adapter = self._frozen(key, spec)
        checkpoint.check_weights(adapter, found)
        checkpoint.copy_weights(adapter, found)
        self._attach(adapter)
        return adapter

    def _generation(self: Engine, request: SampleRequest) -> tuple[Any, str | None]:
        """The checked decode request of a sample request, and its route id; raises the
        `EngineError` naming the field and the limit."""
        from twinkle_server.engine import sampler

        checks.prompt(request.prompt, self.limits, self.base.vocab_size)
        generation = sampler.GenerationRequest(None, np.asarray(request.prompt),
                                               request.num_samples, request.params,
                                               request.topk_logprobs)
        sampler.validate(generation)
        checks.sample_size(request, self.limits)
        route_id = self._sampling_adapter(request.adapter_id, request.weights_path)
        return replace(generation, adapter_id=route_id), route_id

    @replicated
    def decode(self: Engine, requests: Sequence[SampleRequest], keys: Sequence[int], slice_s: float
               ) -> list[tuple[int, Generation | EngineError]]:
        """One slice of continuous batching (`engine.decoding`): new `requests` (answered
        under their `keys`) wait for room in the pool, what fits joins, and the pool
        decodes for about `slice_s` seconds; returns the requests finished, by key. On
        several ranks each rank takes a token-balanced share of the new requests."""
        pool = self.pool
        mine = self.parallel.share([request.num_tokens for request in requests])
        for key, request in ((keys[i], requests[i]) for i in mine):
            try:
                generation, route_id = self._generation(request)
            except EngineError as exc:
                pool.finished.append((key, exc))
                continue
            pool.submit(key, generation, self._namespace(request, route_id))
        self.samplers.trim()
        try:
            done = self._on_base(pool.run, slice_s)
        except OUT_OF_MEMORY as exc:
            stats = pool.stats()
            pool.reset(self._out_of_memory(
                f"a decode slice of {stats.active_rows} rows", "--kv-pool-tokens", exc))
            done, pool.finished = pool.finished, []
        return self.parallel.gather_objects(done)

    @rank_zero_only
    def decode_stats(self: Engine) -> PoolStats:
        """The decode pool's counters and state (rank 0's, on several ranks)."""
        return self.pool.stats()

    @replicated
    def sample_batch(self: Engine, requests: Sequence[SampleRequest]
                     ) -> list[list[SampledSequence] | EngineError]:
        """Sample every request in one decode batch; failures are per-request values."""
        from twinkle_server.engine import sampler

        self.samplers.trim()  # what the last batch routed beyond the cache's size
        results: list[Any] = [None] * len(requests)
        batch, slots = [], []
        for i, request in enumerate(requests):
            try:
                batch.append(self._generation(request)[0])
                slots.append(i)
            except EngineError as exc:
                results[i] = exc
        if not batch:
            return results
        # Requests of one adapter (two sampling sessions of one checkpoint, say) may
        # arrive with another's between.
        order = adapter_order([generation.adapter_id for generation in batch])
        batch, slots = [batch[i] for i in order], [slots[i] for i in order]
        parallel = self.parallel
        # On several ranks each samples a token-balanced share of the batch (every rank
        # computed the same `batch`: the same checks on the same state).
        mine = parallel.share([(r.prompt.size + r.params.max_tokens) * r.num_samples
                               for r in batch])
        try:
            outputs = self._on_base(lambda: sampler.generate(
                self.base.model, self.router.route, [batch[i] for i in mine],
                eos_token_ids=self.base.eos_token_ids, pad_token_id=self.base.pad_token_id,
                decode=self.base.decode, together=parallel.any_rank))
        except OUT_OF_MEMORY as exc:
            sequences = sum(r.num_samples for r in batch)
            outputs = [self._out_of_memory(f"a decode batch of {sequences} sequences",
                                           "--merge-token-budget (or --max-batch-tokens)",
                                           exc)] * len(mine)
        outputs = parallel.gather_objects(outputs)
        for slot, out in zip(slots, outputs, strict=True):
            results[slot] = out
        return results

    @replicated
    def compute_logprobs(self: Engine, adapter_id: str | None, weights_path: str | None,
                         tokens: np.ndarray) -> np.ndarray:
        """Logprob of each token given the ones before it; NaN at position 0."""
        return self.prompt_logprobs(adapter_id, weights_path, tokens).logprobs

    @replicated
    def prompt_logprobs(self: Engine, adapter_id: str | None, weights_path: str | None,
                        tokens: np.ndarray, topk: int = 0) -> Any:
        """`compute_logprobs` plus, with `topk` > 0, the top-k tokens at each position
        (a `prompt_scoring.PromptLogprobs`)."""
        from twinkle_server.engine.prompt_scoring import PromptScoring

        return self.score_prompt(adapter_id, weights_path, tokens,
                                 PromptScoring(include=True, topk=topk))

    @replicated
    def score_prompt(self: Engine, adapter_id: str | None, weights_path: str | None,
                     tokens: np.ndarray, scoring: Any) -> Any:
        """Everything a `prompt_scoring.PromptScoring` asks about `tokens` (own logprobs,
        top-k, target ids, alternative draws), in one pass: a `PromptLogprobs`."""
        from twinkle_server.engine import prompt_scoring

        checks.prompt(np.asarray(tokens), self.limits, self.base.vocab_size)
        prompt_scoring.check(scoring, np.asarray(tokens).size, self.base.vocab_size)
        self.samplers.trim()
        route_id = self._sampling_adapter(adapter_id, weights_path)
        return self._on_base(prompt_scoring.score_prompt, self.base.model, self.router.route,
                             route_id, np.asarray(tokens), scoring)
