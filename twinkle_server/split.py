"""Rank 0's engine of a model split into trainer ranks and sampler ranks (`sampler_ranks`).

`SplitEngine` is an `engine.protocol.EngineAPI`: training verbs, adapter reads and saves go
to the trainer ranks' engine (a `ReplicatedEngine` over them, FSDP2 as on any ranks);
decode slices and prompt scoring go to the sampler ranks (`twinkle_server.sampler_rank`),
each a whole copy of the base with its own decode pool. The scheduler runs the two on
workers of their own (`Scheduler(decode_apart=True)`), so they run at the same time.

Weights reach the sampler ranks in memory, never through the filesystem: an adapter's
LoRA tensors (replicated on every trainer rank, so rank 0 holds them whole) go out over
each sampler rank's weights channel as a `Publication` with a version, at the points the
colocated server would read them:

- `save_weights` (sampler checkpoints and snapshots): as the checkpoint's routing key;
- `publish_inflight`: as the model's inflight key, replacing the previous version;
- a live model's weights: on its first live sample, then again after every
  `optim_step`, `step` and `load_state`;
- a sampler checkpoint no sampler rank holds (saved before a restart, imported): read once
  from disk on rank 0 and published.

Each request carries the version it needs, and a sampler rank starts it only once that
version is live there (the publish gate). Checkpoint keys are kept while any request
routes to them, and beyond that the most recently used `keep` of them; model keys until
the model is removed.

A sampler rank that fails (its channel errs or times out) ends its requests with
UNAVAILABLE naming it; requests go on to the sampler ranks left, and training is not
touched. Under torchrun the launcher then ends the job, as for any lost rank; rank 0
drains first, so in-flight training ops and saves finish.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from twinkle_server.engine import checkpoint
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.base_model import BaseModel
from twinkle_server.engine.errors import (
    EngineError,
    FailedPrecondition,
    NotFound,
    Unavailable,
)
from twinkle_server.engine.prompt_scoring import PromptLogprobs, PromptScoring
from twinkle_server.engine.protocol import EngineAPI
from twinkle_server.engine.sampler_cache import KEY_PREFIX, SAMPLER_CACHE_SIZE, sampler_key
from twinkle_server.engine.sampling.pool import PoolStats
from twinkle_server.engine.sampling.verbs import inflight_key
from twinkle_server.engine.types import (
    AdamParams,
    EngineLimits,
    ForwardOutput,
    ForwardRequest,
    Generation,
    LoraSpec,
    LossSpec,
    SampledSequence,
    SampleRequest,
)
from twinkle_server.sampler_rank import (
    DECODE,
    NOOP,
    PUBLISH,
    RELEASE,
    SCORE,
    STOP,
    Link,
    Need,
    Publication,
)

log = logging.getLogger(__name__)


@dataclass
class _Sampler:
    """Rank 0's view of one sampler rank: its link, the requests it decodes now (key ->
    (tokens, routing key)), its pool's last stats, and why it was lost."""

    link: Link
    calls_lock: threading.Lock = field(default_factory=threading.Lock)
    weights_lock: threading.Lock = field(default_factory=threading.Lock)
    outstanding: dict[int, tuple[int, str | None]] = field(default_factory=dict)
    stats: PoolStats = field(default_factory=PoolStats)
    last_call: float = field(default_factory=time.monotonic)
    last_weights: float = field(default_factory=time.monotonic)
    lost: str | None = None


@dataclass
class PublishStats:
    """What publication has cost since the engine started (for `bench.distributed`)."""

    publications: int = 0
    bytes: int = 0
    seconds: float = 0.0


class SplitEngine:
    """Rank 0's engine of a split model: training on `trainer`, sampling on the sampler
    ranks over `links`, weights published between them. `timeout_s` is the collective
    timeout: idle channels get a no-op well within it."""

    def __init__(self, trainer: EngineAPI, links: Sequence[Link], timeout_s: float,
                 keep: int = SAMPLER_CACHE_SIZE) -> None:
        self.trainer = trainer
        self.samplers = [_Sampler(link) for link in links]
        self.timeout_s, self.keep = timeout_s, keep
        self.published: OrderedDict[str, int] = OrderedDict()
        self.publish_stats = PublishStats()
        self._version = 0
        self._lock = threading.Lock()          # the bookkeeping above and below
        self._publishing = threading.Lock()    # one publication at a time, in version order
        # Held while the trainer changes adapter weights, and while the decode worker reads
        # a live model's to publish them (a sampling session on a live model is not
        # ordered after its training ops), so no publication is torn.
        self._stepping = threading.Lock()
        self._failed: list[tuple[int, EngineError]] = []
        self._closed = threading.Event()
        # One per sampler rank: a hung one holds up its own no-ops only.
        self._keepalive = [threading.Thread(target=self._keep_alive, args=(sampler,),
                                            daemon=True,
                                            name=f"twinkle-keepalive-{sampler.link.rank}")
                           for sampler in self.samplers]
        for thread in self._keepalive:
            thread.start()

    # ------------------------------------------------------------------ the trainer's

    @property
    def base(self) -> BaseModel:
        return self.trainer.base

    @property
    def limits(self) -> EngineLimits:
        return self.trainer.limits

    @property
    def adapters(self) -> Mapping[str, Adapter]:
        return self.trainer.adapters

    def estimate_adapter_bytes(self, spec: LoraSpec) -> int:
        return self.trainer.estimate_adapter_bytes(spec)

    def add_adapter(self, adapter_id: str, spec: LoraSpec,
                    gradient_accumulation_steps: int = 1) -> dict[str, Any]:
        return self.trainer.add_adapter(adapter_id, spec, gradient_accumulation_steps)

    def adapter_info(self, adapter_id: str) -> dict[str, Any]:
        return self.trainer.adapter_info(adapter_id)

    def remove_adapter(self, adapter_id: str) -> None:
        """Remove it from the trainer ranks, and its live and inflight weights from the
        sampler ranks; requests still sampling them fail NOT_FOUND."""
        self.trainer.remove_adapter(adapter_id)
        gone = NotFound(f"model_id: model {adapter_id!r} was unloaded while sampling")
        for key in (adapter_id, inflight_key(adapter_id)):
            self._release(key, gone)

    def check_forward(self, request: ForwardRequest) -> None:
        self.trainer.check_forward(request)

    def validate_forward(self, request: ForwardRequest) -> LossSpec:
        return self.trainer.validate_forward(request)

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

    def get_train_configs(self, adapter_id: str) -> dict[str, Any]:
        return self.trainer.get_train_configs(adapter_id)

    def save_weights(self, adapter_id: str, path: str | Path, overwrite: bool = False) -> int:
        """Save on rank 0, then publish the same tensors as the checkpoint's key."""
        written = self.trainer.save_weights(adapter_id, path, overwrite)
        adapter = self.trainer.adapters[adapter_id]
        self._publish(sampler_key(path), adapter.spec, checkpoint.peft_tensors(adapter))
        return written

    def save_state(self, adapter_id: str, path: str | Path, include_optimizer: bool = True,
                   overwrite: bool = False) -> int:
        return self.trainer.save_state(adapter_id, path, include_optimizer, overwrite)

    def read_checkpoint_spec(self, path: str | Path) -> LoraSpec:
        return self.trainer.read_checkpoint_spec(path)

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
        self._publish(key, adapter.spec, checkpoint.peft_tensors(adapter))
        return key

    def has_sampler(self, weights_path: str | os.PathLike) -> bool:
        with self._lock:
            return sampler_key(weights_path) in self.published

    def sampler_dirs(self) -> set[str]:
        with self._lock:
            return {key[len(KEY_PREFIX):].rsplit("@", 1)[0]
                    for key in self.published if key.startswith(KEY_PREFIX)}

    def _publish(self, key: str, spec: LoraSpec, tensors: Mapping[str, Any]) -> int:
        """Send `tensors` as `key`'s next version to every sampler rank left; its version."""
        with self._publishing:
            started = time.perf_counter()
            with self._lock:
                self._version += 1
                version = self._version
            publication = Publication.of(key, version, spec, dict(tensors))
            for sampler in self._alive():
                self._send_weights(sampler, (PUBLISH, publication))
            with self._lock:
                self.published[key] = version
                self.published.move_to_end(key)
                stats = self.publish_stats
                stats.publications += 1
                stats.bytes += publication.nbytes
                stats.seconds += time.perf_counter() - started
            log.debug("published %s v%d: %d bytes in %.1f ms", key, version,
                      publication.nbytes, 1e3 * (time.perf_counter() - started))
            self._trim()
        return version

    def _republish(self, adapter_id: str) -> None:
        """A live model's weights changed: publish them again when sampler ranks hold them
        (call with `_stepping`)."""
        with self._lock:
            held = adapter_id in self.published
        if held:
            adapter = self.trainer.adapters[adapter_id]
            self._publish(adapter_id, adapter.spec, checkpoint.peft_tensors(adapter))

    def _release(self, key: str, reason: EngineError) -> None:
        with self._publishing:
            with self._lock:
                if self.published.pop(key, None) is None:
                    return
            for sampler in self._alive():
                self._send_weights(sampler, (RELEASE, key, reason))

    def _trim(self) -> None:
        """Release the least recently used checkpoint keys beyond `keep` that no request
        routes to (call with `_publishing`)."""
        with self._lock:
            pinned = {route for s in self.samplers for _, route in s.outstanding.values()}
            spare = [k for k in self.published
                     if k.startswith(KEY_PREFIX) and k not in pinned]
            dropped = spare[:max(0, len(spare) - self.keep)]
            for key in dropped:
                del self.published[key]
        for key in dropped:
            for sampler in self._alive():
                self._send_weights(sampler, (RELEASE, key, NotFound(
                    f"model_path: sampler checkpoint {key!r} was unloaded")))

    def _need(self, adapter_id: str | None, weights_path: str | None) -> Need:
        """The weights a request routes to and their version, published first when no
        sampler rank holds them."""
        if weights_path is not None:
            key = sampler_key(weights_path)
            with self._lock:
                version = self.published.get(key)
                if version is not None:
                    self.published.move_to_end(key)
            if version is None:
                spec, _ = checkpoint.read_spec(weights_path)
                version = self._publish(key, spec, checkpoint.read_weights(weights_path))
            return Need(key, version)
        if adapter_id is None:
            return Need(None, 0)
        with self._lock:
            version = self.published.get(adapter_id)
        if version is not None:
            return Need(adapter_id, version)
        with self._stepping:
            adapter = self.trainer.adapters.get(adapter_id)
            if adapter is None:
                raise NotFound(f"model_id: no model {adapter_id!r}")
            return Need(adapter_id, self._publish(adapter_id, adapter.spec,
                                                  checkpoint.peft_tensors(adapter)))

    # ------------------------------------------------------------------ sampling

    def decode(self, requests: Sequence[SampleRequest], keys: Sequence[int], slice_s: float,
               cancelled: Sequence[int] = ()
               ) -> list[tuple[int, Generation | EngineError]]:
        """One slice on every sampler rank with work, at once: each new request goes
        whole (all its samples) to the sampler rank with the fewest tokens in flight."""
        done: list[tuple[int, Any]] = []
        plans: dict[int, tuple[list, list, list, list]] = {}
        for request, key in zip(requests, keys, strict=True):
            try:
                need = self._need(request.adapter_id, request.weights_path)
            except EngineError as exc:
                done.append((key, exc))
                continue
            sampler = self._least_loaded()
            if sampler is None:
                done.append((key, Unavailable(self._none_left())))
                continue
            with self._lock:
                sampler.outstanding[key] = (request.num_tokens, need.key)
            plan = plans.setdefault(sampler.link.rank, ([], [], [], []))
            plan[0].append(replace(request, adapter_id=need.key, weights_path=None))
            plan[1].append(key)
            plan[2].append(need)
        for key in cancelled:
            owner = next((s for s in self._alive() if key in s.outstanding), None)
            if owner is not None:
                plans.setdefault(owner.link.rank, ([], [], [], []))[3].append(key)
        busy = [s for s in self._alive() if s.link.rank in plans or s.outstanding]
        held = list(busy)
        for sampler in held:
            sampler.calls_lock.acquire()
        try:
            sent = []
            for sampler in busy:
                new, new_keys, needs, stop = plans.get(sampler.link.rank, ([], [], [], []))
                if self._call(sampler, (DECODE, new, new_keys, needs, slice_s, stop)):
                    sent.append(sampler)
            for sampler in sent:
                reply = self._answer(sampler)
                # Free its channel at once: while this waits on a hung sampler rank, the
                # keepalive must still reach the others within their timeout.
                sampler.calls_lock.release()
                held.remove(sampler)
                if reply is not None:
                    with self._lock:
                        for key, _ in reply:
                            sampler.outstanding.pop(key, None)
                    done += reply
        finally:
            for sampler in held:
                sampler.calls_lock.release()
        with self._lock:
            done += self._failed
            self._failed = []
        return done

    def score_prompt(self, adapter_id: str | None, weights_path: str | None,
                     tokens: np.ndarray, scoring: PromptScoring) -> PromptLogprobs:
        """On the least busy sampler rank, once the weights are live there."""
        need = self._need(adapter_id, weights_path)
        sampler = self._least_loaded()
        if sampler is None:
            raise Unavailable(self._none_left())
        with sampler.calls_lock:
            if not self._call(sampler, (SCORE, need, np.asarray(tokens), scoring)):
                raise Unavailable(sampler.lost or self._none_left())
            reply = self._answer(sampler)
        if reply is None:
            raise Unavailable(sampler.lost or self._none_left())
        return reply

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
        with self._lock:
            every = [s.stats for s in self.samplers if s.lost is None]
        return PoolStats(**{f.name: sum(getattr(s, f.name) for s in every)
                            for f in fields(PoolStats)})

    # ------------------------------------------------------------------ links

    def _alive(self) -> list[_Sampler]:
        with self._lock:
            return [s for s in self.samplers if s.lost is None]

    def _least_loaded(self) -> _Sampler | None:
        with self._lock:
            alive = [s for s in self.samplers if s.lost is None]
            return min(alive, key=lambda s: (sum(t for t, _ in s.outstanding.values()),
                                             s.link.rank), default=None)

    def _none_left(self) -> str:
        lost = [s.lost for s in self.samplers if s.lost is not None]
        return "sampling: no sampler rank is left" + (f"; {lost[-1]}" if lost else "")

    def _call(self, sampler: _Sampler, message: tuple) -> bool:
        """Send a call (holding its `calls_lock`); False when the link failed."""
        try:
            sampler.link.calls.send(message)
            sampler.last_call = time.monotonic()
            return True
        except Exception as exc:
            self._lose(sampler, exc)
            return False

    def _answer(self, sampler: _Sampler) -> Any:
        """The answer to the call just sent (raised when it is an engine error), or None
        when the link failed."""
        try:
            status, value, stats = sampler.link.calls.receive(src=sampler.link.rank)
        except Exception as exc:
            self._lose(sampler, exc)
            return None
        sampler.stats = stats
        if status == "error":
            raise value
        return value

    def _send_weights(self, sampler: _Sampler, message: tuple) -> None:
        with sampler.weights_lock:
            try:
                sampler.link.weights.send(message)
                sampler.last_weights = time.monotonic()
            except Exception as exc:
                self._lose(sampler, exc)

    def _lose(self, sampler: _Sampler, exc: BaseException) -> None:
        """The link to `sampler` failed: its requests end UNAVAILABLE naming it (returned
        by the next `decode`), and nothing is sent to it again."""
        with self._lock:
            if sampler.lost is not None:
                return
            left = sum(s.lost is None for s in self.samplers) - 1
            sampler.lost = (f"sampling: sampler rank {sampler.link.rank} is lost "
                            f"({type(exc).__name__}: {str(exc)[:300]}); its requests failed, "
                            f"{left} sampler rank{'s' if left != 1 else ''} left")
            self._failed += [(key, Unavailable(sampler.lost)) for key in sampler.outstanding]
            sampler.outstanding.clear()
        log.error("%s", sampler.lost)

    def _keep_alive(self, sampler: _Sampler) -> None:
        """No-ops on `sampler`'s idle channels, so it never times out waiting on either."""
        interval = max(0.05, self.timeout_s / 4)
        while not self._closed.wait(interval / 2) and sampler.lost is None:
            for lock, channel in ((sampler.calls_lock, sampler.link.calls),
                                  (sampler.weights_lock, sampler.link.weights)):
                last = (sampler.last_call if channel is sampler.link.calls
                        else sampler.last_weights)
                if time.monotonic() - last < interval or not lock.acquire(blocking=False):
                    continue
                try:
                    channel.send((NOOP,))
                    if channel is sampler.link.calls:
                        sampler.last_call = time.monotonic()
                    else:
                        sampler.last_weights = time.monotonic()
                except Exception as exc:
                    self._lose(sampler, exc)
                finally:
                    lock.release()

    def close(self) -> None:
        """Stop the trainer ranks and the sampler ranks (those still reachable)."""
        self._closed.set()
        for thread in self._keepalive:
            thread.join()
        close = getattr(self.trainer, "close", None)
        if close is not None:
            close()
        for sampler in self._alive():
            for lock, channel in ((sampler.calls_lock, sampler.link.calls),
                                  (sampler.weights_lock, sampler.link.weights)):
                with lock:
                    try:
                        channel.send((STOP,))
                    except Exception as exc:
                        log.warning("could not stop sampler rank %d: %s",
                                    sampler.link.rank, exc)
