"""Rank 0's engine of a model split into trainer ranks and sampler ranks (`sampler_ranks`).

`SplitEngine` is an `engine.protocol.EngineAPI`: training verbs, adapter reads and saves go
to the trainer ranks' engine (a `ReplicatedEngine` over them, FSDP2 as on any ranks);
decode slices and prompt scoring go to the sampler ranks (`twinkle_server.ranks.sampler_rank`),
each a whole copy of the base with its own decode pool, over `sampler_links`. The
scheduler runs the two on workers of their own (`Scheduler(decode_apart=True)`), so they
run at the same time.

Weights reach the sampler ranks in memory, never through the filesystem: an adapter's
LoRA tensors (replicated on every trainer rank, so rank 0 holds them whole) go out over
each sampler rank's weights channel as a `Publication` with a version, at the points the
colocated server would read them:

- `save_weights` (sampler checkpoints and snapshots): as the checkpoint's routing key;
- `publish_inflight`: as the model's inflight key, replacing the previous version;
- a live model's weights: on its first live sample, then again after every
  `optim_step`, `step` and `load_state`;
- a sampler checkpoint no sampler rank holds (saved before a restart, imported, or let go
  as below): read from disk on rank 0 and published.

Each request carries the version it needs, and a sampler rank starts it only once that
version is live there (the publish gate). Checkpoint keys are kept while any request
routes to them, and beyond that the most recently used `keep` of them; model keys until
the model is removed.

A sampler rank that fails ends its requests with UNAVAILABLE naming it: at once when its
process dies (the connection drops), within the collective timeout when it hangs.
Requests go on to the sampler ranks left, and training is not touched. Under torchrun a
rank that dies ends the job (the launcher stops every rank; rank 0 drains first, so
in-flight training ops and saves finish); one that hangs does not, and the server serves
on without it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from twinkle_server.engine import checkpoint
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.errors import EngineError, FailedPrecondition, NotFound
from twinkle_server.engine.prompt_scoring import PromptLogprobs, PromptScoring
from twinkle_server.engine.protocol import EngineAPI
from twinkle_server.engine.sampler_cache import KEY_PREFIX, SAMPLER_CACHE_SIZE, sampler_key
from twinkle_server.engine.sampling.book import PoolStats
from twinkle_server.engine.sampling.verbs import inflight_key
from twinkle_server.engine.types import (
    AdamParams,
    ForwardOutput,
    ForwardRequest,
    Generation,
    LoraSpec,
    LossSpec,
    Progress,
    SampledSequence,
    SampleRequest,
)
from twinkle_server.ranks.reads import RankZeroReads
from twinkle_server.ranks.sampler_links import SamplerEnd, SamplerLinks
from twinkle_server.ranks.sampler_rank import (
    DECODE,
    PUBLISH,
    RELEASE,
    SCORE,
    Link,
    Need,
    Publication,
)

log = logging.getLogger(__name__)
_ROUTE_TRIES = 3
"""Publications of a request's weights before it is refused: another thread may let a
checkpoint key go between its publication and the request's pinning it (`_trim`)."""


@dataclass
class PublishStats:
    """What has been published since the engine started (for `bench.split`)."""

    publications: int = 0
    bytes: int = 0


class SplitEngine(RankZeroReads):
    """Rank 0's engine of a split model: training on `trainer`, sampling on the sampler
    ranks over `links`, weights published between them. `timeout_s` is the collective
    timeout: idle channels get a no-op well within it."""

    def __init__(self, trainer: EngineAPI, links: Sequence[Link], timeout_s: float,
                 keep: int = SAMPLER_CACHE_SIZE) -> None:
        super().__init__(trainer)
        self.trainer = trainer
        self.links = SamplerLinks(links, timeout_s)
        self.keep = keep
        self.published: OrderedDict[str, int] = OrderedDict()
        """Routing key -> the version last published (guarded by `links.lock`)."""
        self.publish_stats = PublishStats()
        self._version = 0
        self._publishing = threading.Lock()    # one publication at a time, in version order
        # Held while the trainer changes adapter weights or removes an adapter, and while
        # the decode worker reads a live model's weights to publish them (a sampling
        # session on a live model is not ordered after its training ops): no publication
        # is torn, and none outlives its model.
        self._stepping = threading.Lock()

    # ------------------------------------------------------------------ the trainer's

    def add_adapter(self, adapter_id: str, spec: LoraSpec,
                    gradient_accumulation_steps: int = 1, owner: str = "") -> dict[str, Any]:
        return self.trainer.add_adapter(adapter_id, spec, gradient_accumulation_steps, owner)

    def remove_adapter(self, adapter_id: str) -> None:
        """Remove it from the trainer ranks, and its live and inflight weights from the
        sampler ranks; requests still sampling them fail NOT_FOUND."""
        with self._stepping:
            self.trainer.remove_adapter(adapter_id)
            gone = NotFound(f"model_id: model {adapter_id!r} was unloaded while sampling")
            for key in (adapter_id, inflight_key(adapter_id)):
                self._release(key, gone)

    def forward_batch(self, requests: Sequence[ForwardRequest]
                      ) -> list[ForwardOutput | EngineError]:
        return self.trainer.forward_batch(requests)

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        with self._stepping:
            out = self.trainer.optim_step(adapter_id, params)
            self._republish(adapter_id)
        return out

    def set_loss(self, adapter_id: str, loss: LossSpec) -> None:
        self.trainer.set_loss(adapter_id, loss)

    def set_optimizer(self, adapter_id: str, name: str, kwargs: dict[str, Any]) -> None:
        self.trainer.set_optimizer(adapter_id, name, kwargs)

    def set_lr_scheduler(self, adapter_id: str, name: str, kwargs: dict[str, Any]) -> None:
        self.trainer.set_lr_scheduler(adapter_id, name, kwargs)

    def clip_grad_norm(self, adapter_id: str, max_norm: float) -> float:
        return self.trainer.clip_grad_norm(adapter_id, max_norm)

    def step(self, adapter_id: str) -> dict[str, float]:
        with self._stepping:
            out = self.trainer.step(adapter_id)
            self._republish(adapter_id)
        return out

    def zero_grad(self, adapter_id: str) -> None:
        self.trainer.zero_grad(adapter_id)

    def lr_step(self, adapter_id: str) -> None:
        self.trainer.lr_step(adapter_id)

    def calculate_metric(self, adapter_id: str, is_training: bool = True) -> dict[str, float]:
        return self.trainer.calculate_metric(adapter_id, is_training)

    def save_weights(self, adapter_id: str, path: str | Path, overwrite: bool = False) -> int:
        """Save on rank 0, then publish the same tensors as the checkpoint's key."""
        written = self.trainer.save_weights(adapter_id, path, overwrite)
        adapter = self.trainer.adapters[adapter_id]
        self._publish_adapter(sampler_key(path), adapter)
        return written

    def load_state(self, adapter_id: str, path: str | os.PathLike, include_optimizer: bool,
                   adopt_accumulation: bool = False) -> None:
        with self._stepping:
            self.trainer.load_state(adapter_id, path, include_optimizer, adopt_accumulation)
            self._republish(adapter_id)

    # ------------------------------------------------------------------ publication

    def publish_inflight(self, adapter_id: str) -> str:
        """Publish the model's weights as its inflight key, a new version of it."""
        adapter = self.trainer.adapters.get(adapter_id)
        if adapter is None:
            raise NotFound(f"model_id: no model {adapter_id!r}")
        key = inflight_key(adapter_id)
        self._publish_adapter(key, adapter)
        return key

    def has_sampler(self, weights_path: str | os.PathLike) -> bool:
        with self.links.lock:
            return sampler_key(weights_path) in self.published

    def sampler_dirs(self) -> set[str]:
        with self.links.lock:
            return {key[len(KEY_PREFIX):].rsplit("@", 1)[0]
                    for key in self.published if key.startswith(KEY_PREFIX)}

    def _publish(self, key: str, spec: LoraSpec, tensors: Mapping[str, Any]) -> int:
        """Queue `tensors` as `key`'s next version for every sampler rank left (copied
        now, sent by each rank's sender thread); returns the version."""
        with self._publishing:
            self._version += 1
            publication = Publication.of(key, self._version, spec, dict(tensors))
            self.links.post((PUBLISH, publication))
            with self.links.lock:
                self.published[key] = publication.version
                self.published.move_to_end(key)
                self.publish_stats.publications += 1
                self.publish_stats.bytes += publication.nbytes
            self._trim()
            return publication.version

    def _publish_adapter(self, key: str, adapter: Adapter) -> int:
        """Publish `adapter`'s weights as they are now under `key`; returns the version."""
        return self._publish(key, adapter.spec, checkpoint.peft_tensors(adapter))

    def _republish(self, adapter_id: str) -> None:
        """A live model's weights changed: publish them again when sampler ranks hold them
        (call with `_stepping`)."""
        with self.links.lock:
            held = adapter_id in self.published
        if held:
            adapter = self.trainer.adapters[adapter_id]
            self._publish_adapter(adapter_id, adapter)

    def _release(self, key: str, reason: EngineError) -> None:
        with self._publishing:
            with self.links.lock:
                if self.published.pop(key, None) is None:
                    return
            self.links.post((RELEASE, key, reason))

    def _trim(self) -> None:
        """Let go the least recently used checkpoint keys beyond `keep` that no request
        routes to (call with `_publishing`)."""
        with self.links.lock:
            pinned = self.links.pinned()
            spare = [k for k in self.published if k.startswith(KEY_PREFIX) and k not in pinned]
            dropped = spare[:max(0, len(spare) - self.keep)]
            for key in dropped:
                del self.published[key]
        for key in dropped:
            self.links.post((RELEASE, key, NotFound(
                f"model_path: sampler checkpoint {key!r} was unloaded")))

    def _need(self, adapter_id: str | None, weights_path: str | None) -> Need:
        """The weights a request routes to and their version, published first when no
        sampler rank holds them."""
        if weights_path is not None:
            key = sampler_key(weights_path)
            with self.links.lock:
                version = self.published.get(key)
                if version is not None:
                    self.published.move_to_end(key)
            if version is None:
                spec, _ = checkpoint.read_spec(weights_path)
                version = self._publish(key, spec, checkpoint.read_weights(weights_path))
            return Need(key, version)
        if adapter_id is None:
            return Need(None, 0)
        with self.links.lock:
            version = self.published.get(adapter_id)
        if version is not None:
            return Need(adapter_id, version)
        with self._stepping:
            adapter = self.trainer.adapters.get(adapter_id)
            if adapter is None:
                raise NotFound(f"model_id: no model {adapter_id!r}")
            return Need(adapter_id, self._publish_adapter(adapter_id, adapter))

    def _route(self, adapter_id: str | None, weights_path: str | None, tokens: int,
               key: int | None = None) -> tuple[Need, int, SamplerEnd]:
        """The request's weights, published if needed, and the sampler rank it goes to,
        its key (a private one when None) pinning them there until it is answered."""
        for _ in range(_ROUTE_TRIES):
            need = self._need(adapter_id, weights_path)
            routed = self.links.route(key, tokens, need.key, lambda held=need.key: (
                held is None or held in self.published))
            if routed is not None:
                return need, *routed
        raise NotFound(f"sampling: the weights of {weights_path or adapter_id!r} were let "
                       f"go {_ROUTE_TRIES} times before the request could start; retry it")

    # ------------------------------------------------------------------ sampling

    def decode(self, requests: Sequence[SampleRequest], keys: Sequence[int], slice_s: float,
               cancelled: Sequence[int] = ()
               ) -> list[tuple[int, Generation | EngineError | Progress]]:
        """One slice on every sampler rank with work, at once: each new request goes
        whole (all its samples) to the sampler rank with the fewest tokens in flight."""
        done: list[tuple[int, Any]] = []
        calls: dict[SamplerEnd, tuple[list, list, list, list]] = {}
        for request, key in zip(requests, keys, strict=True):
            try:
                need, _, sampler = self._route(request.adapter_id, request.weights_path,
                                               request.num_tokens, key)
            except Exception as exc:
                done.append((key, exc if isinstance(exc, EngineError) else EngineError(
                    f"sampling: {type(exc).__name__}: {exc}")))
                continue
            new, new_keys, needs, _ = calls.setdefault(sampler, ([], [], [], []))
            new.append(replace(request, adapter_id=need.key, weights_path=None))
            new_keys.append(key)
            needs.append(need)
        for key in cancelled:
            if (owner := self.links.owner(key)) is not None:
                calls.setdefault(owner, ([], [], [], []))[3].append(key)
        for sampler in self.links.alive():
            if sampler.outstanding and sampler not in calls:
                calls[sampler] = ([], [], [], [])
        answers = self.links.call_all({s: (DECODE, *plan[:3], slice_s, plan[3])
                                       for s, plan in calls.items()})
        for sampler, (_, answered) in answers:
            self.links.done(sampler, [key for key, result in answered
                                      if not isinstance(result, Progress)])
            done += answered
        return done + self.links.take_failed()

    def score_prompt(self, adapter_id: str | None, weights_path: str | None,
                     tokens: np.ndarray, scoring: PromptScoring) -> PromptLogprobs:
        """On the least busy sampler rank, once the weights are live there."""
        tokens = np.asarray(tokens)
        need, key, sampler = self._route(adapter_id, weights_path, tokens.size)
        try:
            status, value = self.links.call(sampler, (SCORE, need, tokens, scoring))
        finally:
            self.links.done(sampler, [key])
        if status == "error":
            raise value
        return value

    def prompt_logprobs(self, adapter_id: str | None, weights_path: str | None,
                        tokens: np.ndarray, topk: int = 0) -> PromptLogprobs:
        return self.score_prompt(adapter_id, weights_path, tokens,
                                 PromptScoring(include=True, topk=topk))

    def compute_logprobs(self, adapter_id: str | None, weights_path: str | None,
                         tokens: np.ndarray) -> np.ndarray:
        return self.prompt_logprobs(adapter_id, weights_path, tokens).logprobs

    def sample_batch(self, requests: Sequence[SampleRequest]
                     ) -> list[list[SampledSequence] | EngineError]:
        raise FailedPrecondition("sampler: sampler ranks decode with the continuous sampler; "
                                 "--sampler static serves without sampler_ranks")

    def decode_stats(self) -> PoolStats:
        """The sampler ranks' pools together: counters and state summed."""
        return self.links.stats()

    def close(self) -> None:
        """Stop the trainer ranks and the sampler ranks (those still reachable)."""
        close = getattr(self.trainer, "close", None)
        if close is not None:
            close()
        self.links.close()
