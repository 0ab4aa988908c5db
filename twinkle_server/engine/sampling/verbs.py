"""The engine's sampling half: sampler checkpoints kept loaded, inflight targets, the decode
pool (continuous batching), the static batch and prompt scoring.

`Sampling` is a part the engine composes: it reads the base, the router, the adapters and
the ranks through `SamplingHost` (what `engine.Engine` offers it) and owns the sampling
state. The engine's verbs (`decode`, `sample_batch`, `publish_inflight`, ...) call it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, Protocol, TypeVar

import numpy as np

from twinkle_server.engine import checkpoint, checks
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.base_model import BaseModel
from twinkle_server.engine.errors import EngineError, FailedPrecondition, InvalidArgument
from twinkle_server.engine.lora import LoraWeights, adapter_order
from twinkle_server.engine.memory import OUT_OF_MEMORY
from twinkle_server.engine.parallel import Parallel
from twinkle_server.engine.sampler_cache import SamplerCache
from twinkle_server.engine.sampling.book import PoolStats
from twinkle_server.engine.sampling.cache_layers import (
    sliding_layers,
    state_layers,
    unsupported_layers,
)
from twinkle_server.engine.sampling.pool import DecodePool
from twinkle_server.engine.sampling.pool import refusal as pool_refusal
from twinkle_server.engine.sampling.static import Route, generate
from twinkle_server.engine.types import (
    EngineLimits,
    Generation,
    LoraSpec,
    Progress,
    SampledSequence,
    SampleRequest,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


TRAINS_ONLY = ("sampling: this engine holds a split model's trainer ranks, which do not "
               "sample; its sampler ranks do")


def inflight_key(adapter_id: str) -> str:
    """The routing id of a model's inflight target (`Sampling.publish_inflight`)."""
    return f"inflight:{adapter_id}"


class SamplingHost(Protocol):
    """What the sampling half reads of its engine."""

    base: BaseModel
    limits: EngineLimits
    parallel: Parallel
    adapters: dict[str, Adapter]
    samples: bool
    batch_invariant: bool

    @property
    def pass_tokens(self) -> int: ...
    def _adapter(self, adapter_id: str) -> Adapter: ...
    def _targets(self, spec: LoraSpec) -> list[str]: ...
    def _new_weights(self, spec: LoraSpec, targets: list[str]) -> dict[str, LoraWeights]: ...
    def _attach(self, adapter: Adapter) -> None: ...
    def _detach(self, adapter_id: str, names: Any) -> None: ...
    def _on_base(self, fn: Callable[..., T], *args: Any) -> T: ...
    def _out_of_memory(self, what: str, remedy: str, exc: BaseException) -> EngineError: ...


class Sampling:
    """Sampler checkpoints, inflight targets and the decode pool of one engine."""

    def __init__(self, host: SamplingHost, route: Route) -> None:
        self.host, self.route = host, route
        base = host.base
        self.samplers = SamplerCache(self._load_sampler,
                                     lambda key, adapter: host._detach(key, adapter.weights),
                                     pinned=self._pinned)
        # Frozen targets by routing id: inflight ones (`publish_inflight`) and weights
        # published to a sampler rank (`install`), with the version each holds: what its
        # sessions' prefix cache is keyed by.
        self.targets: dict[str, Adapter] = {}
        self.versions: dict[str, int] = {}
        # A model whose cache the pool cannot hold samples only with `--sampler static`
        # (said on a split model's trainer ranks too, which hold no pool: they start first).
        self.pool: DecodePool | None = None
        self.pool_refusal = pool_refusal(base.model.config)
        config = base.model.config
        if host.batch_invariant and (unsupported := unsupported_layers(config)
                                     + sliding_layers(config) + state_layers(config)):
            raise InvalidArgument(
                f"--batch-invariant on: the model has layers other than full causal "
                f"attention ({', '.join(unsupported)}), which batch-invariant sampling does "
                "not compute; serve it with --batch-invariant off")
        if host.samples and self.pool_refusal is None:
            self.pool = DecodePool(
                base.model, route, eos_token_ids=base.eos_token_ids,
                pad_token_id=base.pad_token_id, decode=base.decode,
                capacity=host.limits.kv_pool_tokens, prefill_tokens=host.pass_tokens,
                parallel=host.parallel, fault=self._fault,
                batch_invariant=host.batch_invariant)

    def _pinned(self) -> set[str]:
        return self.pool.routes() if self.pool is not None else set()

    def _fault(self, exc: BaseException, what: str) -> EngineError:
        """The error the requests a failed forward of the pool can be held to get; on
        several ranks it raises instead (`Engine._out_of_memory`)."""
        if isinstance(exc, OUT_OF_MEMORY):
            return self.host._out_of_memory(what, "--kv-pool-tokens", exc)
        if self.host.parallel.world > 1:
            raise exc
        if isinstance(exc, EngineError):
            return exc
        log.error("sampling: %s failed", what, exc_info=exc)
        return EngineError(f"sampling: {what} failed: {type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ routes

    def has_sampler(self, weights_path: str | os.PathLike) -> bool:
        return weights_path in self.samplers

    def sampler_dirs(self) -> set[str]:
        return self.samplers.dirs()

    def route_of(self, adapter_id: str | None, weights_path: str | None) -> str | None:
        """The route id of a request, loading a sampler checkpoint if needed."""
        if adapter_id is not None:
            if adapter_id not in self.targets:
                self.host._adapter(adapter_id)
            return adapter_id
        return None if weights_path is None else self.samplers.route(weights_path)

    def _frozen(self, key: str, spec: LoraSpec) -> Adapter:
        """A frozen adapter of `spec`'s shape routed as `key`, to copy weights into."""
        host = self.host
        adapter = Adapter(key, spec, host._new_weights(LoraSpec(**{**asdict(spec), "seed": 0}),
                                                       host._targets(spec)))
        for param in adapter.parameters():
            param.requires_grad_(False)
        return adapter

    def _load_sampler(self, key: str, weights_path: str) -> Adapter:
        """The sampler checkpoint at `weights_path` as a frozen adapter routed as `key`,
        attached to the base once its weights are checked."""
        spec, _ = checkpoint.read_spec(weights_path)
        found = checkpoint.read_weights(weights_path)
        adapter = self._frozen(key, spec)
        checkpoint.check_weights(adapter, found)
        checkpoint.copy_weights(adapter, found)
        self.host._attach(adapter)
        return adapter

    def publish_inflight(self, adapter_id: str) -> str:
        """Copy the adapter's weights into its inflight target (made on first use) and
        return the target's routing id. Rows decoding from it take the new weights at
        their next step."""
        source = self.host._adapter(adapter_id)
        key = inflight_key(adapter_id)
        self.install(key, self.versions.get(key, 0) + 1, source.spec,
                     checkpoint.peft_tensors(source))
        return key

    def install(self, key: str, version: int, spec: LoraSpec,
                tensors: dict[str, Any]) -> None:
        """`tensors` (PEFT keys, `spec`'s shape) as the frozen target routed as `key`, at
        `version`: made on first use, or remade when the shape changed; refused, changing
        nothing, when they do not match `spec`. Rows decoding from it take the new weights
        at their next step."""
        target = self.targets.get(key)
        if target is None or target.spec != spec:
            fresh = self._frozen(key, spec)
            checkpoint.check_weights(fresh, tensors)
            if target is not None:
                self.host._detach(key, target.weights)
            self.targets[key] = target = fresh
            self.host._attach(target)
        else:
            checkpoint.check_weights(target, tensors)
        checkpoint.copy_weights(target, tensors)
        self.versions[key] = version

    def release(self, key: str, error: EngineError) -> None:
        """Drop the target routed as `key`; requests still routed to it end with `error`."""
        if self.pool is not None:
            self.pool.fail(key, error)
        if (target := self.targets.pop(key, None)) is not None:
            self.host._detach(key, target.weights)
        self.versions.pop(key, None)

    def forget(self, adapter_id: str, error: EngineError) -> None:
        """An adapter is being removed: end the requests routed to it or its inflight
        target with `error`, and drop the target."""
        if self.pool is not None:
            self.pool.fail(adapter_id, error)
        self.release(inflight_key(adapter_id), error)

    def _namespace(self, request: SampleRequest, route: str | None) -> tuple[str, str] | None:
        """The prefix-cache namespace of a request: its session and its weights' version
        (a checkpoint's key, the base, or an inflight publication); none for a live
        adapter, whose weights change under it with every step."""
        if not request.cache_namespace:
            return None
        if route in self.targets:
            version = f"{route}#{self.versions[route]}"
        elif route is not None and route in self.host.adapters:
            return None
        else:
            version = route or "base"
        return request.cache_namespace, version

    def _checked(self, request: SampleRequest) -> str | None:
        """Every check of a sample request, each naming its field and limit; its route."""
        host = self.host
        checks.prompt(np.asarray(request.prompt), host.limits, host.base.vocab_size)
        checks.sampling(request)
        checks.sample_size(request, host.limits)
        return self.route_of(request.adapter_id, request.weights_path)

    # ------------------------------------------------------------------ sampling

    def decode(self, requests: Sequence[SampleRequest], keys: Sequence[int], slice_s: float,
               cancelled: Sequence[int] = ()) -> list[tuple[int, Generation | EngineError | Progress]]:
        """One slice of continuous batching; see `Engine.decode`."""
        if self.pool is None:
            raise self.pool_refusal or FailedPrecondition(TRAINS_ONLY)
        pool, parallel = self.pool, self.host.parallel
        pool.cancel(cancelled)
        for i in parallel.share([request.num_tokens for request in requests]):
            try:
                route = self._checked(requests[i])
            except EngineError as exc:
                pool.answer(keys[i], exc)
                continue
            pool.submit(keys[i], requests[i], route, self._namespace(requests[i], route))
        self.samplers.trim()
        try:
            done = self.host._on_base(pool.run, slice_s)
        except Exception as exc:    # a fault the pool could not hold to one request
            pool.reset(self._fault(exc, "a decode slice"))
            done = pool.take_finished()
        return parallel.gather_objects(done)

    def stats(self) -> PoolStats:
        return self.pool.stats() if self.pool is not None else PoolStats()

    def sample_batch(self, requests: Sequence[SampleRequest]
                     ) -> list[list[SampledSequence] | EngineError]:
        """Sample every request in one static batch; failures are per-request values."""
        host = self.host
        if not host.samples:
            raise FailedPrecondition(TRAINS_ONLY)
        self.samplers.trim()  # what the last batch routed beyond the cache's size
        results: list[Any] = [None] * len(requests)
        batch, routes, slots = [], [], []
        for i, request in enumerate(requests):
            try:
                routes.append(self._checked(request))
                batch.append(request)
                slots.append(i)
            except EngineError as exc:
                results[i] = exc
        if not batch:
            return results
        # Requests of one adapter (two sampling sessions of one checkpoint, say) may
        # arrive with another's between.
        order = adapter_order(routes)
        batch, routes, slots = ([batch[i] for i in order], [routes[i] for i in order],
                                [slots[i] for i in order])
        parallel = host.parallel
        # On several ranks each samples a token-balanced share of the batch (every rank
        # computed the same `batch`: the same checks on the same state).
        mine = parallel.share([r.num_tokens for r in batch])
        base = host.base
        try:
            outputs: list[Any] = host._on_base(lambda: generate(
                base.model, self.route, [batch[i] for i in mine], [routes[i] for i in mine],
                eos_token_ids=base.eos_token_ids, pad_token_id=base.pad_token_id,
                decode=base.decode, together=parallel.any_rank,
                batch_invariant=host.batch_invariant))
        except OUT_OF_MEMORY as exc:
            sequences = sum(r.num_samples for r in batch)
            outputs = [host._out_of_memory(f"a decode batch of {sequences} sequences",
                                           "--merge-token-budget (or --max-batch-tokens)",
                                           exc)] * len(mine)
        outputs = parallel.gather_objects(outputs)
        for slot, out in zip(slots, outputs, strict=True):
            results[slot] = out
        return results

    def score_prompt(self, adapter_id: str | None, weights_path: str | None,
                     tokens: np.ndarray, scoring: Any) -> Any:
        """Everything a `prompt_scoring.PromptScoring` asks about `tokens`, in one pass."""
        from twinkle_server.engine import prompt_scoring

        host = self.host
        checks.prompt(np.asarray(tokens), host.limits, host.base.vocab_size)
        prompt_scoring.check(scoring, np.asarray(tokens).size, host.base.vocab_size)
        self.samplers.trim()
        route = self.route_of(adapter_id, weights_path)
        return host._on_base(prompt_scoring.score_prompt, host.base.model, self.route,
                             route, np.asarray(tokens), scoring)
