"""The engine: one frozen base model, many LoRA adapters, merged forward passes.

`Engine` is a plain Python object with no network: the gRPC services drive it through
the scheduler, and tests and benchmarks use it directly as the reference. It is not
thread-safe by design: one compute worker (the scheduler's) calls it.

Isolation contract: what an adapter gets in a merged pass, against its pass alone
(`tests/numerics.py` holds the tolerances below, and the tests that check them).

* Datums never mix. Each is its own sequence (packed, its positions restart and its
  attention stays inside it), and the multi-LoRA layer adds an adapter's delta to its
  own tokens only, by the same matmuls on the same tokens as alone (`lora.py`). Another
  adapter's data, NaNs or failure never reach its loss, logprobs or gradients.
* Numbers agree to float32 rounding, not bit for bit. The frozen base projection is one
  GEMM over every token of the pass, and BLAS picks its kernel, so its summation order,
  by the GEMM's row count and the CPU: on AMD EPYC (AVX2 or AVX-512, MKL) a 40-row GEMM
  and a 10-row one round some rows differently. With float32 eps = 1.2e-7 and 4096 (the
  vocabulary) the longest reduction: losses to relative 1e-5 (eps * sqrt(4096) =
  7.6e-6); logprobs to absolute 1e-5 (a log-sum-exp's error is absolute); gradients to
  1e-4 of the tensor's largest element (they sum over every token, through every layer).
  Measured over four kernel choices: 1.1e-7, 9.5e-7 and 2.8e-6.
* Weights after N AdamW steps at learning rate lr agree within 1e-2 * lr * N, element by
  element. Adam divides each gradient element by its own running size, so the rounding
  of an element that nearly cancels becomes a visible step: measured up to
  1.0e-3 * lr * N, where weighting one token's loss by 0.999 instead of 1 moves some
  weight by 0.7 * lr * N.
* Seeded sampling draws the same numbers alone or batched, so it picks the same tokens
  unless a draw lands within rounding of the boundary between two tokens (rare, but
  about once in a thousand draws on the tiny model's flat distribution: tests compare up
  to the first near tie, `tests/numerics.py`); their logprobs agree to 1e-5. With
  `--batch-invariant on` they are the same bit for bit (`engine.batch_invariant`).
* Exact, bit for bit, where the shapes and the code are the same: the same request on
  the same adapter state run twice in one process; a retried seq_id (the stored result);
  token ids and counters; a checkpoint's weights and optimizer state after a save and
  load; and the weights, optimizer state and pending gradients of an adapter that no op
  touched (one whose request was refused or whose loss was not finite included).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import transformers

from twinkle_server.engine import activations, checks, experts, heap, memory, recurrent, roles
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.base_model import BaseModel
from twinkle_server.engine.errors import (
    EngineError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from twinkle_server.engine.lora import (
    LoraWeights,
    Router,
    inject,
    named_patterns,
    resolve_targets,
)
from twinkle_server.engine.memory import available_memory_bytes
from twinkle_server.engine.packing import check_attention
from twinkle_server.engine.parallel import OneRank, Parallel
from twinkle_server.engine.prompt_scoring import PromptLogprobs, PromptScoring
from twinkle_server.engine.protocol import rank_zero_only, replicated
from twinkle_server.engine.residency import Residency, Spill
from twinkle_server.engine.sampling.book import PoolStats
from twinkle_server.engine.sampling.verbs import Sampling, inflight_key
from twinkle_server.engine.seq_len import resolve_seq_len
from twinkle_server.engine.training import Training
from twinkle_server.engine.types import (
    AUTO_PASS_TOKENS,
    EngineLimits,
    ForwardRequest,
    Generation,
    LoraSpec,
    Progress,
    SampledSequence,
    SampleRequest,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


__all__ = ["Engine", "ForwardRequest", "SampleRequest", "inflight_key"]



# Adam keeps two moments per weight and the gradient one more: 4 copies of the weights.
_STATE_COPIES = 4


class Engine(Training, Residency):
    """Trains and samples many LoRA adapters on one frozen base model.

    Owns the base, the memory sizing and the adapters; the training verbs (merged passes,
    optimizer verbs, save and load) are `engine.training`'s, the sampling verbs
    `sampling.verbs`'.
    """

    def __init__(self, base: BaseModel, limits: EngineLimits = EngineLimits(),
                 packing: bool = True, activation_checkpointing: bool | None = False,
                 parallel: Parallel | None = None, samples: bool = True,
                 batch_invariant: bool = False, spill: Spill | None = None) -> None:
        self.base = base
        # Packed passes and decode steps replace an sdpa or eager model's attention with
        # the engine's own, which must compute every argument its layers pass (Gemma 2's
        # soft cap, gpt-oss's sinks): one short probe forward, before anything is injected.
        check_attention(base.model, base.arch)
        # Sampling forwards whose every row computes as it would alone
        # (`engine.batch_invariant`, `--batch-invariant on`).
        self.batch_invariant = batch_invariant
        # False: a split model's trainer ranks, whose sampler ranks sample; no decode pool
        # is sized here or counted against the memory its adapters and passes take.
        self.samples = samples
        self.limits = limits if samples else replace(limits, kv_pool_tokens=0)
        # Merged passes pack their datums into one sequence; False pads them (the baseline).
        self.packing = packing
        self.router = Router()
        self.layers = inject(base.model, self.router)
        # Linear attention and Mamba keep packed datums apart by running per datum
        # (`engine.recurrent`); a stateful layer of a kind it does not know cannot pack.
        if (refused := recurrent.refusal(base.model, transformers.__version__)) is not None:
            raise refused
        mixers = recurrent.install(base.model, self.router)
        if mixers:
            log.info("packed passes run %s per datum (%d layers)",
                     " and ".join(sorted(set(mixers.values()))), len(mixers))
        stateful = recurrent.unpackable(base.model)
        if packing and stateful is not None:
            log.warning("merged passes are padded, not packed: %s carries state along the "
                        "sequence and the engine cannot restart it per datum", stateful)
            self.packing = False
        self.peft_refused = recurrent.peft_refused(base.model, list(self.layers))
        # MoE experts (fused parameters, not linears): LoRA per expert (`engine.experts`).
        self.experts = experts.inject(base.model, self.router)
        # On several ranks (`engine.parallel`): the base sharded with FSDP2, passes split by
        # datum; every rank makes the same calls in order (`twinkle_server.ranks.replication`).
        # One process alone is the trivial `OneRank`: the same code, every collective the
        # identity.
        self.parallel = parallel = parallel if parallel is not None else OneRank(base.device)
        parallel.shard(base.model)
        # On several ranks a pass also gathers the base's weights, beside its activations.
        gathered = parallel.gathered_bytes()
        limits = self.limits = resolve_seq_len(base, self.limits, self._free_bytes,
                                               activation_checkpointing, gathered)
        # Decoder layers recomputed in backward (`engine.activations`); None picks by
        # the memory free once the base is in place (`memory.auto_checkpointing`).
        if activation_checkpointing is None:
            activation_checkpointing = activations.auto(base.model, memory.auto_checkpointing(
                base.config, base.dtype, base.vocab_size, base.device.type,
                self._free_bytes(), limits.max_seq_len, gathered))
        self.activation_checkpointing = activation_checkpointing
        if activation_checkpointing:
            activations.enable(base.model, self.router,
                               keep_input_grads=parallel.keeps_input_grads)
        out = base.model.get_output_embeddings()
        self.output_layer = next((n for n, m in self.layers.items() if m is out), "lm_head")
        # What Tinker's switches select on this model (`engine.roles`), logged once.
        self.roles = roles.layer_roles(base.model, self.layers, self.output_layer)
        log.info("Tinker's LoRA switches select, by role: %s",
                 roles.describe(self.roles, self.peft_refused))
        self.adapters: dict[str, Adapter] = {}
        self._init_residency(spill)
        self.heap = heap.Trimmer()     # freed pass memory back to the OS (engine.heap)
        if limits.max_pass_tokens == AUTO_PASS_TOKENS:
            limits = replace(limits, max_pass_tokens=memory.auto_pass_tokens(
                base.config, base.dtype, base.vocab_size, base.device.type,
                self._free_bytes(), limits.max_seq_len, activation_checkpointing, gathered))
            log.info("passes run through the base in pieces of at most %d tokens "
                     "(--max-pass-tokens)", limits.max_pass_tokens)
            self.limits = limits
        if limits.max_pass_tokens and limits.max_pass_tokens < limits.max_seq_len:
            raise InvalidArgument(
                f"max_pass_tokens: {limits.max_pass_tokens} is under the {limits.max_seq_len}-"
                "token --max-seq-len; a datum is never split, so a piece of a pass must hold "
                "the longest (--max-pass-tokens)")
        # Activations + one logits chunk of the largest piece of a pass the limits allow:
        # shared by every adapter, kept free beside their state (`engine.memory`).
        self.pass_headroom_bytes = gathered + memory.pass_headroom_bytes(
            base.config, base.dtype, base.vocab_size, self.pass_tokens, activation_checkpointing)
        # Reserved beside adapter state on accelerators, and wherever `max_pass_tokens`
        # bounds a pass (1.6 GiB for the tiny model's 16,384 tokens); an unbounded pass on
        # CPU (17.9 GiB at 262,144 tokens) would refuse adapters on ordinary machines, so
        # there it is reported, not reserved.
        self.reserve_pass_memory = base.device.type != "cpu" or limits.max_pass_tokens > 0
        if samples and not limits.kv_pool_tokens:
            self.limits = limits = replace(limits, kv_pool_tokens=memory.auto_kv_pool_tokens(
                base.config, base.dtype, self._free_bytes()))
            log.info("the sampler's KV pool holds %d positions (--kv-pool-tokens)",
                     limits.kv_pool_tokens)
        self.sampling = Sampling(self, self.router.route)

    @classmethod
    def load(cls, model: str, *, device: str = "auto", dtype: str = "auto",
             cache_dir: str | None = None, limits: EngineLimits = EngineLimits(),
             packing: bool = True, activation_checkpointing: bool | None = False,
             parallel: Parallel | None = None, samples: bool = True,
             batch_invariant: bool = False, spill: Spill | None = None) -> Engine:
        """An engine on `model` (a local dir, a hub name in the cache, or `tiny`);
        `packing` False pads merged passes instead of packing them (`--packing off`);
        `activation_checkpointing` recomputes decoder layers in backward
        (`--activation-checkpointing on`; None: `auto`); `parallel` shards it over ranks (on the
        rank's own device, whatever `device` says; `Parallel.load_base`); `samples` False
        trains only (a split model's trainer ranks: no decode pool); `batch_invariant`
        samples every row as it would alone (`engine.batch_invariant`); `spill` sends
        adapters paged out past a host budget to disk (`engine.residency`)."""
        parallel = parallel if parallel is not None else OneRank()
        base = parallel.load_base(model, device=device, dtype=dtype, cache_dir=cache_dir)
        return cls(base, limits, packing, activation_checkpointing, parallel, samples,
                   batch_invariant, spill)

    @property
    def pass_tokens(self) -> int:
        """The most tokens one piece of a pass runs through the base."""
        return self.limits.max_pass_tokens or self.limits.max_batch_tokens

    def _free_bytes(self) -> int | None:
        """Free memory for new state, the least over the ranks (every rank holds the
        adapters, and runs its share of each pass); within `limits.memory_bytes` when the
        model has a budget on a shared device."""
        free = available_memory_bytes(self.base.device)
        budget = self.limits.memory_bytes
        if budget:
            left = max(0, budget - self._held_bytes())
            free = left if free is None else min(free, left)
        return self.parallel.min_int(free)

    def _held_bytes(self) -> int:
        """What this engine holds on this rank: its share of the base's weights, every
        adapter's state and the decode pool's KV bound (once sized)."""
        adapters = getattr(self, "adapters", {})
        return (memory.module_bytes(self.base.model)
                + sum(a.num_params for a in adapters.values()) * 4 * _STATE_COPIES
                + self.limits.kv_pool_tokens * memory.kv_bytes_per_token(self.base.config,
                                                                         self.base.dtype))

    def _on_base(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` with the base model's weights at hand (gathered, on several ranks)."""
        return self.parallel.run(fn, *args)

    # ------------------------------------------------------------------ adapters

    def _targets(self, spec: LoraSpec) -> list[str]:
        """The linear layers `spec` trains (its expert projections: `experts.targets`).
        'all-linear' and Tinker's role switches leave out those PEFT refuses LoRA on
        (Mamba's `out_proj`: `recurrent.peft_refused`); a module name that selects one is
        refused."""
        linear = experts.linear_spec(spec, self.layers, self.experts)
        if linear is None:
            return []
        # Switches may select experts and no linear (every MLP an MoE block, train_mlp).
        trains_experts = bool(experts.targets(self.experts, spec))
        targets = resolve_targets(self.layers, linear, self.output_layer, self.roles,
                                  allow_empty=trains_experts)
        refused = [t for t in targets if t in self.peft_refused]
        if not refused:
            return targets
        named = named_patterns(linear.target_modules)
        if named:
            by_name = resolve_targets(self.layers, replace(linear, target_modules=named),
                                      self.output_layer, self.roles)
            if any(t in self.peft_refused for t in by_name):
                raise InvalidArgument(
                    f"lora.target_modules: selects {refused[:3]}, which PEFT refuses LoRA "
                    f"on in a {self.base.config.model_type} model (Mamba kernels read its "
                    "out_proj weights directly), so the adapter could not be exported; "
                    "leave them out")
        return [t for t in targets if t not in self.peft_refused]

    @rank_zero_only
    def estimate_adapter_bytes(self, spec: LoraSpec) -> int:
        """Weights + gradients + AdamW moments of an adapter with this spec, in bytes
        (its own state only; `add_adapter` also keeps `pass_headroom_bytes` free)."""
        params = sum(spec.rank * (self.layers[n].in_features + self.layers[n].out_features)
                     for n in self._targets(spec))
        params += experts.parameter_count(self.experts, experts.targets(self.experts, spec),
                                          spec.rank)
        return params * 4 * _STATE_COPIES

    @replicated
    def add_adapter(self, adapter_id: str, spec: LoraSpec,
                    gradient_accumulation_steps: int = 1, owner: str = "") -> dict[str, Any]:
        """Create an adapter of tenant `owner`, resident; past `--max-adapters` resident
        ones another pages out, fairly between tenants (`engine.residency`). Refuses with
        the numbers when memory runs out.

        Memory: the adapter's state (`estimate_adapter_bytes`) plus, on an accelerator
        (`reserve_pass_memory`), the pass headroom (`pass_headroom_bytes`: the largest
        pass `--max-batch-tokens` allows, see `engine.memory`) must fit in what is free
        now, so a request within the limits cannot run the device out of memory."""
        if adapter_id in self.adapters:
            raise InvalidArgument(f"adapter_id: {adapter_id!r} already exists")
        if gradient_accumulation_steps < 1:
            raise InvalidArgument("gradient_accumulation_steps: must be >= 1, "
                                  f"got {gradient_accumulation_steps}")
        checks.lora_spec(spec, self.limits)
        targets = self._targets(spec)
        expert_targets = experts.targets(self.experts, spec)
        if not targets and not expert_targets:
            raise InvalidArgument("lora.target_modules: selects no layer of the base model; "
                                  "name linear layers or expert projections")
        need = self.estimate_adapter_bytes(spec)
        headroom = self.pass_headroom_bytes if self.reserve_pass_memory else 0
        free = self._free_bytes()
        if free is not None and need + headroom > free:
            raise ResourceExhausted(
                f"memory: adapter needs {need / 2**20:.1f} MiB (weights, gradients, AdamW "
                f"state for rank {spec.rank} on {len(targets) + len(expert_targets)} layers) plus "
                f"{headroom / 2**20:.1f} MiB pass headroom (activations and logits of a "
                f"{self.pass_tokens}-token pass) "
                f"but only {free / 2**20:.1f} MiB are free; use a smaller rank or fewer target "
                "modules, or a lower --max-pass-tokens")
        if spec.seed is None:
            spec = LoraSpec(**{**asdict(spec), "seed": secrets.randbits(31)})
        self._make_room({adapter_id}, owner)    # another pages out past the slots
        adapter = Adapter(adapter_id, spec, self._new_weights(spec, targets),
                          grad_accum=gradient_accumulation_steps)
        self._attach(adapter)
        self.adapters[adapter_id] = adapter
        self.resident[adapter_id] = None
        self._owners[adapter_id] = owner
        return self.adapter_info(adapter_id)

    def _new_weights(self, spec: LoraSpec, targets: list[str]) -> dict[str, LoraWeights]:
        """Fresh weights for the linears `targets` and the expert projections `spec`
        trains (keyed by PEFT module path, `engine.experts`)."""
        generator = torch.Generator().manual_seed(int(spec.seed or 0))
        weights = {name: LoraWeights(self.layers[name].in_features,
                                     self.layers[name].out_features, spec, generator,
                                     self.base.device) for name in targets}
        return {**weights, **experts.new_weights(
            self.experts, experts.targets(self.experts, spec), spec, generator,
            self.base.device)}

    def _attach(self, adapter: Adapter) -> None:
        for name, weights in adapter.weights.items():
            if name in self.layers:
                self.layers[name].adapters[adapter.adapter_id] = weights
        experts.attach(self.experts, adapter.adapter_id, adapter.weights)

    def _detach(self, adapter_id: str, names: Iterable[str]) -> None:
        for name in names:
            if name in self.layers:
                self.layers[name].adapters.pop(adapter_id, None)
        experts.detach(self.experts, adapter_id)

    @rank_zero_only
    def adapter_info(self, adapter_id: str) -> dict[str, Any]:
        """Trainable parameter count, state bytes, resolved target modules and spec."""
        adapter = self._adapter(adapter_id)
        return {"trainable_params": adapter.num_params,
                "state_bytes": adapter.num_params * 4 * _STATE_COPIES,
                "target_modules": sorted(getattr(w, "parameter", name)   # experts: theirs
                                         for name, w in adapter.weights.items()),
                "spec": adapter.spec}

    @replicated
    def remove_adapter(self, adapter_id: str) -> None:
        """Detach the adapter (and its inflight target) from every layer and drop its
        state, freeing its slot; rows still sampling from either fail NOT_FOUND."""
        adapter = self._known(adapter_id)
        self.sampling.forget(adapter_id, NotFound(
            f"model_id: model {adapter_id!r} was unloaded while sampling"))
        self._detach(adapter_id, adapter.weights)
        self._forget_residency(adapter_id)
        del self.adapters[adapter_id]

    # ------------------------------------------------------------------ sampling

    @rank_zero_only
    def has_sampler(self, weights_path: str | Path) -> bool:
        """Whether the sampler checkpoint at `weights_path`, as its files are now, is
        loaded (cached)."""
        return self.sampling.has_sampler(weights_path)

    @rank_zero_only
    def sampler_dirs(self) -> set[str]:
        """The directories (real paths) of the sampler checkpoints loaded now."""
        return self.sampling.sampler_dirs()

    @replicated
    def publish_inflight(self, adapter_id: str) -> str:
        """Copy the adapter's weights into its inflight target (made on first use) and
        return the target's routing id: what Tinker's inflight sampling clients share."""
        return self.sampling.publish_inflight(adapter_id)

    @replicated
    def decode(self, requests: Sequence[SampleRequest], keys: Sequence[int], slice_s: float,
               cancelled: Sequence[int] = ()) -> list[tuple[int, Generation | EngineError | Progress]]:
        """One slice of continuous batching (`engine.sampling.pool`): the requests under
        `cancelled` (keys of earlier calls) leave the pool, new `requests` (answered under
        their `keys`) wait for room, what fits joins, and the pool decodes for about
        `slice_s` seconds; returns the requests finished, by key, each with its result
        or the error it alone failed with, and a streamed request still decoding with its
        `Progress`. On several ranks each rank takes a token-balanced share of the new
        requests."""
        done = self.sampling.decode(requests, keys, slice_s, cancelled)
        self.heap.after_pass()
        return done

    @rank_zero_only
    def decode_stats(self) -> PoolStats:
        """The decode pool's counters and state (rank 0's, on several ranks)."""
        return self.sampling.stats()

    @replicated
    def sample_batch(self, requests: Sequence[SampleRequest]
                     ) -> list[list[SampledSequence] | EngineError]:
        """Sample every request in one static batch; failures are per-request values."""
        sampled = self.sampling.sample_batch(requests)
        self.heap.after_pass()
        return sampled

    @replicated
    def compute_logprobs(self, adapter_id: str | None, weights_path: str | None,
                         tokens: np.ndarray) -> np.ndarray:
        """Logprob of each token given the ones before it; NaN at position 0."""
        return self.prompt_logprobs(adapter_id, weights_path, tokens).logprobs

    @replicated
    def prompt_logprobs(self, adapter_id: str | None, weights_path: str | None,
                        tokens: np.ndarray, topk: int = 0) -> PromptLogprobs:
        """`compute_logprobs` plus, with `topk` > 0, the top-k tokens at each position."""
        return self.score_prompt(adapter_id, weights_path, tokens,
                                 PromptScoring(include=True, topk=topk))

    @replicated
    def score_prompt(self, adapter_id: str | None, weights_path: str | None,
                     tokens: np.ndarray, scoring: PromptScoring) -> PromptLogprobs:
        """Everything a `prompt_scoring.PromptScoring` asks about `tokens` (own logprobs,
        top-k, target ids, alternative draws), in one pass."""
        return self.sampling.score_prompt(adapter_id, weights_path, tokens, scoring)
