"""The engine: one frozen base model, many LoRA adapters, merged forward passes.

`Engine` is a plain Python object with no network: the gRPC services drive it through
the scheduler, and tests and benchmarks use it directly as the reference. It is not
thread-safe by design: one compute worker (the scheduler's) calls it.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from twinkle_server.engine import checkpoint, losses, optim
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.base_model import BaseModel, load_base_model
from twinkle_server.engine.errors import (
    EngineError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from twinkle_server.engine.lora import LoraWeights, Router, inject, resolve_targets
from twinkle_server.engine.types import (
    AdamParams,
    Datum,
    EngineLimits,
    ForwardOutput,
    LoraSpec,
    LossSpec,
    SampledSequence,
    SamplingParams,
)

# Adam keeps two moments per weight and the gradient one more: 4 copies of the weights.
_STATE_COPIES = 4
# Sampler checkpoints kept loaded for sampling, least recently used evicted first.
_SAMPLER_CACHE_SIZE = 8


@dataclass(frozen=True)
class ForwardRequest:
    """One request's datums for one adapter; `loss` None means the adapter's native loss."""

    adapter_id: str
    datums: Sequence[Datum]
    loss: LossSpec | None
    backward: bool


@dataclass(frozen=True)
class SampleRequest:
    """Sample from a live adapter, a saved sampler checkpoint, or (both None) the base."""

    adapter_id: str | None
    weights_path: str | None
    prompt: np.ndarray
    num_samples: int
    params: SamplingParams


class Engine:
    """Trains and samples many LoRA adapters on one frozen base model."""

    def __init__(self, base: BaseModel, limits: EngineLimits = EngineLimits()) -> None:
        self.base = base
        self.limits = limits
        self.router = Router()
        self.layers = inject(base.model, self.router)
        out = base.model.get_output_embeddings()
        self.output_layer = next((n for n, m in self.layers.items() if m is out), "lm_head")
        self.adapters: dict[str, Adapter] = {}
        self._samplers: OrderedDict[str, Adapter] = OrderedDict()

    @classmethod
    def load(cls, model: str, *, device: str = "auto", dtype: str = "auto",
             cache_dir: str | None = None, limits: EngineLimits = EngineLimits()) -> Engine:
        return cls(load_base_model(model, device=device, dtype=dtype, cache_dir=cache_dir),
                   limits)

    # ------------------------------------------------------------------ adapters

    def _targets(self, spec: LoraSpec) -> list[str]:
        return resolve_targets(self.layers, spec, self.output_layer)

    def estimate_adapter_bytes(self, spec: LoraSpec) -> int:
        """Weights + gradients + AdamW moments of an adapter with this spec, in bytes."""
        params = sum(spec.rank * (self.layers[n].in_features + self.layers[n].out_features)
                     for n in self._targets(spec))
        return params * 4 * _STATE_COPIES

    def _check_spec(self, spec: LoraSpec) -> None:
        if not 1 <= spec.rank <= self.limits.max_rank:
            raise InvalidArgument(
                f"lora.rank: {spec.rank} is outside [1, {self.limits.max_rank}] (--max-rank)")
        for name in ("alpha", "dropout"):
            if not math.isfinite(getattr(spec, name)):
                raise InvalidArgument(f"lora.{name}: must be finite")
        if not 0.0 <= spec.dropout < 1.0:
            raise InvalidArgument(f"lora.dropout: {spec.dropout} is outside [0, 1)")

    def add_adapter(self, adapter_id: str, spec: LoraSpec,
                    gradient_accumulation_steps: int = 1) -> dict[str, Any]:
        """Create an adapter; refuses with the numbers when slots or memory run out."""
        if adapter_id in self.adapters:
            raise InvalidArgument(f"adapter_id: {adapter_id!r} already exists")
        if len(self.adapters) >= self.limits.max_adapters:
            raise ResourceExhausted(
                f"adapters: all {self.limits.max_adapters} adapter slots are in use "
                "(--max-adapters); unload an adapter or close an idle session")
        if gradient_accumulation_steps < 1:
            raise InvalidArgument("gradient_accumulation_steps: must be >= 1, "
                                  f"got {gradient_accumulation_steps}")
        self._check_spec(spec)
        targets = self._targets(spec)
        need = self.estimate_adapter_bytes(spec)
        free = available_memory_bytes(self.base.device)
        if free is not None and need > free:
            raise ResourceExhausted(
                f"memory: adapter needs {need / 2**20:.1f} MiB (weights, gradients, AdamW "
                f"state for rank {spec.rank} on {len(targets)} layers) but only "
                f"{free / 2**20:.1f} MiB are free; use a smaller rank or fewer target modules")
        if spec.seed is None:
            spec = LoraSpec(**{**asdict(spec), "seed": secrets.randbits(31)})
        adapter = Adapter(adapter_id, spec, self._new_weights(spec, targets),
                          grad_accum=gradient_accumulation_steps)
        self._attach(adapter)
        self.adapters[adapter_id] = adapter
        return self.adapter_info(adapter_id)

    def _new_weights(self, spec: LoraSpec, targets: list[str]) -> dict[str, LoraWeights]:
        generator = torch.Generator().manual_seed(int(spec.seed or 0))
        return {name: LoraWeights(self.layers[name].in_features, self.layers[name].out_features,
                                  spec, generator, self.base.device) for name in targets}

    def _attach(self, adapter: Adapter) -> None:
        for name, weights in adapter.weights.items():
            self.layers[name].adapters[adapter.adapter_id] = weights

    def _detach(self, adapter_id: str, names) -> None:
        for name in names:
            self.layers[name].adapters.pop(adapter_id, None)

    def adapter_info(self, adapter_id: str) -> dict[str, Any]:
        adapter = self._adapter(adapter_id)
        return {"trainable_params": adapter.num_params,
                "state_bytes": adapter.num_params * 4 * _STATE_COPIES,
                "target_modules": sorted(adapter.weights), "spec": adapter.spec}

    def remove_adapter(self, adapter_id: str) -> None:
        adapter = self._adapter(adapter_id)
        self._detach(adapter_id, adapter.weights)
        del self.adapters[adapter_id]

    def adapter_ids(self) -> list[str]:
        return list(self.adapters)

    def _adapter(self, adapter_id: str) -> Adapter:
        if adapter_id not in self.adapters:
            raise NotFound(f"model_id: no model {adapter_id!r}")
        return self.adapters[adapter_id]

    # ------------------------------------------------------------------ forward

    def check_forward(self, request: ForwardRequest) -> None:
        """The checks that depend only on the request, the limits and the vocabulary.

        They read no adapter state, so a front may run them as soon as a request arrives
        (a bad batch then fails before it queues); `forward_batch` runs them again with
        the checks against the adapter, in the adapter's op order.
        """
        if not request.datums:
            raise InvalidArgument("data: the batch is empty")
        vocab, total = self.base.vocab_size, 0
        for index, datum in enumerate(request.datums):
            n = datum.num_tokens
            if n == 0:
                raise InvalidArgument(f"datum[{index}].input_ids: the sequence is empty")
            if n > self.limits.max_seq_len:
                raise InvalidArgument(f"datum[{index}].input_ids: {n} tokens is over the "
                                      f"{self.limits.max_seq_len}-token limit (--max-seq-len)")
            total += n
            for key in ("input_ids", "target_tokens"):
                ids = datum.input_ids if key == "input_ids" else datum.loss_inputs.get(key)
                if ids is not None and ids.size and (ids.max() >= vocab or ids.min() < 0):
                    bad = ids.max() if ids.max() >= vocab else ids.min()
                    raise InvalidArgument(f"datum[{index}].{key}: token id {int(bad)} is "
                                          f"outside the vocabulary [0, {vocab})")
            for key, value in datum.loss_inputs.items():
                if value.ndim == 0 or value.shape[0] != n:
                    raise InvalidArgument(
                        f"datum[{index}].loss_fn_inputs[{key!r}]: length "
                        f"{value.shape[0] if value.ndim else 0} differs from the {n} input tokens")
        if total > self.limits.max_batch_tokens:
            raise InvalidArgument(f"data: {total} tokens is over the "
                                  f"{self.limits.max_batch_tokens}-token batch limit "
                                  "(--max-batch-tokens)")
        if request.loss is not None:
            losses.validate_loss(request.loss, request.datums)

    def validate_forward(self, request: ForwardRequest) -> LossSpec:
        """Every check before compute, each naming the field and the limit; returns the
        loss the request runs with (its own, or the adapter's from `set_loss`).

        Reads the adapter, so it belongs on the worker, in the adapter's op order: a
        `set_loss` queued just before this request has run by then.
        """
        adapter = self._adapter(request.adapter_id)
        self.check_forward(request)
        if request.loss is not None:
            return request.loss
        if adapter.loss is None:
            raise FailedPrecondition("loss_fn: none given and none set with set_loss")
        losses.validate_loss(adapter.loss, request.datums)
        return adapter.loss

    def forward_batch(self, requests: Sequence[ForwardRequest]
                      ) -> list[ForwardOutput | EngineError]:
        """Run all requests in ONE base-model pass; a failure is that request's value."""
        results: list[ForwardOutput | EngineError | None] = [None] * len(requests)
        valid: list[int] = []
        for i, request in enumerate(requests):
            try:
                self.validate_forward(request)
                valid.append(i)
            except EngineError as exc:
                results[i] = exc
        if valid:
            self._run_forward([requests[i] for i in valid], valid, results)
        return results  # type: ignore[return-value]

    def _run_forward(self, requests: list[ForwardRequest], slots: list[int],
                     results: list) -> None:
        # Group the rows by adapter (stable, first appearance): the router needs each
        # adapter's rows contiguous, and a single-adapter batch becomes one fast segment.
        first_seen: dict[str, int] = {}
        for request in requests:
            first_seen.setdefault(request.adapter_id, len(first_seen))
        order = sorted(range(len(requests)), key=lambda i: first_seen[requests[i].adapter_id])
        requests = [requests[i] for i in order]
        slots = [slots[i] for i in order]
        rows = [(r, d) for r in requests for d in r.datums]
        device = self.base.device
        lengths = [d.num_tokens for _, d in rows]
        width = max(lengths)
        ids = torch.full((len(rows), width), self.base.pad_token_id, dtype=torch.long)
        for row, (_, datum) in enumerate(rows):
            ids[row, :datum.num_tokens] = torch.tensor(np.asarray(datum.input_ids))
        # No mask when nothing is padded: the plain causal path is the fastest kernel.
        mask = None
        if min(lengths) != width:
            mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long().to(device)
        backward = any(r.backward for r in requests)
        route = self.router.route([r.adapter_id for r, _ in rows],
                                  [r.backward for r, _ in rows])
        with torch.set_grad_enabled(backward), route:
            logits = self.base.model(input_ids=ids.to(device), attention_mask=mask,
                                     use_cache=False).logits
        # One fused cross-entropy over the real (unpadded) positions of every row with
        # per-position targets, not one call per datum and nothing spent on padding.
        simple = [d.loss_inputs["target_tokens"].ndim == 1 for _, d in rows]
        if mask is None and all(simple):
            # Every position is real: no gather, whose copy and backward scatter of the
            # whole logits tensor cost more than the loss itself.
            flat_logits = logits.flatten(0, 1)
        else:
            real = torch.cat([row * width + torch.arange(n)
                              for row, n in enumerate(lengths) if simple[row]] or
                             [torch.zeros(0, dtype=torch.long)]).to(device)
            flat_logits = logits.flatten(0, 1)[real]
        flat_targets = torch.cat([torch.tensor(np.asarray(d.loss_inputs["target_tokens"]))
                                  for (_, d), ok in zip(rows, simple, strict=True) if ok]
                                 or [torch.zeros(0, dtype=torch.long)]).to(device)
        flat = target_logprobs(flat_logits, flat_targets)
        with torch.no_grad():
            hits = (flat_logits.argmax(-1) == flat_targets).float()
        row, offset = 0, 0
        to_backward: list[torch.Tensor] = []
        for request, slot in zip(requests, slots, strict=True):
            adapter = self.adapters[request.adapter_id]
            loss_spec = request.loss or adapter.loss
            lps, inputs = [], []
            correct = 0.0
            for datum in request.datums:
                n = datum.num_tokens
                tensors = {k: torch.tensor(np.asarray(v)).to(device)
                           for k, v in datum.loss_inputs.items()}
                if simple[row]:
                    lp, hit = flat[offset:offset + n], hits[offset:offset + n]
                    offset += n
                    weights = tensors.get("weights")
                    correct += float((hit * (weights != 0) if weights is not None else hit).sum())
                else:
                    lp = target_logprobs(logits[row, :n], tensors["target_tokens"])
                lps.append(lp)
                inputs.append(tensors)
                row += 1
            # Native losses divide a training micro-batch by the accumulation count so the
            # window's gradients add up to one big batch's; an eval pass is not divided, and
            # the loss reported (output, metrics, calculate_metric) is the batch's own mean.
            native = losses.LOSSES[loss_spec.name].native
            divisor = adapter.grad_accum if native and request.backward else 1
            loss, metrics = losses.compute_loss(loss_spec, lps, inputs, divisor)
            if divisor != 1:
                metrics = {k: v * divisor if k.startswith("loss:") else v
                           for k, v in metrics.items()}
            if not torch.isfinite(loss):
                results[slot] = InvalidArgument(
                    f"loss: {loss_spec.name} is not finite ({float(loss.detach())}); this "
                    "batch's gradient was discarded and the adapter is unchanged")
                continue
            if request.backward:
                to_backward.append(loss)
                adapter.tokens_seen += sum(d.num_tokens for d in request.datums)
            book = adapter.train_metrics if request.backward else adapter.eval_metrics
            reported = float(loss.detach()) * divisor
            book.add(reported, correct, metrics["tokens:sum"])
            results[slot] = ForwardOutput(
                logprobs=[lp.detach().float().cpu().numpy() for lp in lps],
                loss=reported, metrics=metrics)
        if to_backward:
            self._backward(to_backward, requests, slots, results)

    def _backward(self, to_backward: list[torch.Tensor], requests: list[ForwardRequest],
                  slots: list[int], results: list) -> None:
        """Backpropagate the kept losses; adapters not trained by them keep their grads.

        Autograd also reaches adapters in the batch whose loss is not backpropagated
        (forward-only, or discarded as non-finite): their rows add zeros, or NaN when
        their own logits are NaN (0 * NaN in the fused cross-entropy backward). Their
        gradients are saved before and put back after, bit for bit.
        """
        trained = {r.adapter_id for r, s in zip(requests, slots, strict=True)
                   if r.backward and isinstance(results[s], ForwardOutput)}
        kept = [(p, None if p.grad is None else p.grad.clone())
                for a in {r.adapter_id for r in requests} - trained
                for p in self.adapters[a].parameters()]
        torch.stack(to_backward).sum().backward()
        for param, grad in kept:
            param.grad = grad

    # ------------------------------------------------------------------ Tinker optimizer

    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        """AdamW with exactly `params`, optional clipping, then zero the gradients."""
        adapter = self._adapter(adapter_id)
        if adapter.optimizer is None:
            adapter.optimizer = optim.make_adamw(adapter.parameters(), params)
            adapter.optimizer_name = "AdamW"
        elif not isinstance(adapter.optimizer, torch.optim.AdamW):
            raise FailedPrecondition(f"optim_step: the adapter uses {adapter.optimizer_name} "
                                     "(set_optimizer); optim_step needs AdamW")
        optim.apply_adam_params(adapter.optimizer, params)
        norm = optim.clip_grad_norm(adapter.parameters(), params.grad_clip_norm)
        adapter.optimizer.step()
        adapter.zero_grad()
        adapter.step += 1
        adapter.last_grad_norm = norm
        return {"grad_norm": norm, "learning_rate": params.learning_rate,
                "step": float(adapter.step)}

    # ------------------------------------------------------------------ native loop

    def set_loss(self, adapter_id: str, loss: LossSpec) -> None:
        losses.resolve_config(loss)
        self._adapter(adapter_id).loss = loss

    def set_optimizer(self, adapter_id: str, name: str, kwargs: dict[str, Any]) -> None:
        adapter = self._adapter(adapter_id)
        adapter.optimizer = optim.build_optimizer(name, adapter.parameters(), **kwargs)
        adapter.optimizer_name, adapter.optimizer_kwargs = name, dict(kwargs)
        if adapter.scheduler_name:
            adapter.scheduler = optim.build_scheduler(adapter.scheduler_name, adapter.optimizer,
                                                      **adapter.scheduler_kwargs)

    def set_lr_scheduler(self, adapter_id: str, name: str, kwargs: dict[str, Any]) -> None:
        adapter = self._adapter(adapter_id)
        if adapter.optimizer is None:
            raise FailedPrecondition("lr_scheduler: call set_optimizer first")
        adapter.scheduler = optim.build_scheduler(name, adapter.optimizer, **kwargs)
        adapter.scheduler_name, adapter.scheduler_kwargs = name, dict(kwargs)

    def clip_grad_norm(self, adapter_id: str, max_norm: float) -> float:
        adapter = self._adapter(adapter_id)
        if not adapter.step_applies_next:
            return optim.grad_norm(adapter.parameters())
        adapter.last_grad_norm = optim.clip_grad_norm(adapter.parameters(), max_norm)
        return adapter.last_grad_norm

    def step(self, adapter_id: str) -> dict[str, float]:
        """Count a micro-step; every `grad_accum`-th one applies the optimizer."""
        adapter = self._adapter(adapter_id)
        if adapter.optimizer is None:
            raise FailedPrecondition("step: no optimizer; call set_optimizer first")
        adapter.micro_step += 1
        applied = adapter.at_boundary
        if applied:
            adapter.optimizer.step()
            adapter.step += 1
        return {"applied": float(applied), "step": float(adapter.step),
                "micro_step": float(adapter.micro_step)}

    def zero_grad(self, adapter_id: str) -> None:
        adapter = self._adapter(adapter_id)
        if adapter.at_boundary:
            adapter.zero_grad()

    def lr_step(self, adapter_id: str) -> None:
        adapter = self._adapter(adapter_id)
        if adapter.scheduler is not None and adapter.at_boundary and adapter.micro_step:
            adapter.scheduler.step()

    def calculate_metric(self, adapter_id: str, is_training: bool = True) -> dict[str, float]:
        """Averages since the last call (then reset), plus the adapter's counters."""
        adapter = self._adapter(adapter_id)
        book = adapter.train_metrics if is_training else adapter.eval_metrics
        out = {
            "loss": book.loss_sum / book.batches if book.batches else float("nan"),
            "token_accuracy": book.correct / book.tokens if book.tokens else float("nan"),
            "grad_norm": adapter.last_grad_norm,
            "lr": adapter.learning_rate(),
            "tokens_seen": float(adapter.tokens_seen),
            "steps": float(adapter.step),
        }
        book.__init__()
        return out

    def get_train_configs(self, adapter_id: str) -> dict[str, Any]:
        adapter = self._adapter(adapter_id)
        return {
            "lora": {**asdict(adapter.spec), "target_modules": sorted(adapter.weights)},
            "optimizer": {"name": adapter.optimizer_name, "kwargs": adapter.optimizer_kwargs},
            "lr_scheduler": {"name": adapter.scheduler_name, "kwargs": adapter.scheduler_kwargs},
            "loss": asdict(adapter.loss) if adapter.loss else None,
            "gradient_accumulation_steps": adapter.grad_accum,
            "step": adapter.step, "micro_step": adapter.micro_step,
            "tokens_seen": adapter.tokens_seen,
        }

    # ------------------------------------------------------------------ checkpoints

    def _peft_tensors(self, adapter: Adapter) -> dict[str, torch.Tensor]:
        return {checkpoint.peft_key(name, which): getattr(w, which)
                for name, w in adapter.weights.items() for which in ("lora_A", "lora_B")}

    def _fill_weights(self, adapter: Adapter, out: Path) -> None:
        checkpoint.write_peft(out, adapter.spec, self._peft_tensors(adapter),
                              sorted(adapter.weights), str(self.base.model_dir))

    def save_weights(self, adapter_id: str, path: str | Path, overwrite: bool = False) -> int:
        """PEFT weights only (a sampler checkpoint); returns bytes written."""
        adapter = self._adapter(adapter_id)
        return checkpoint.write_atomically(path, lambda out: self._fill_weights(adapter, out),
                                           overwrite)

    def save_state(self, adapter_id: str, path: str | Path, include_optimizer: bool = True,
                   overwrite: bool = False) -> int:
        """PEFT weights plus, with `include_optimizer`, everything needed to resume exactly."""
        adapter = self._adapter(adapter_id)

        def fill(out: Path) -> None:
            self._fill_weights(adapter, out)
            if include_optimizer:
                checkpoint.write_state(out, self._training_state(adapter))
        return checkpoint.write_atomically(path, fill, overwrite)

    def _training_state(self, adapter: Adapter) -> dict[str, Any]:
        return {
            "optimizer": adapter.optimizer.state_dict() if adapter.optimizer else None,
            "optimizer_name": adapter.optimizer_name,
            "optimizer_kwargs": adapter.optimizer_kwargs,
            "scheduler": adapter.scheduler.state_dict() if adapter.scheduler else None,
            "scheduler_name": adapter.scheduler_name,
            "scheduler_kwargs": adapter.scheduler_kwargs,
            "loss": asdict(adapter.loss) if adapter.loss else None,
            "counters": {"step": adapter.step, "micro_step": adapter.micro_step,
                         "tokens_seen": adapter.tokens_seen, "grad_accum": adapter.grad_accum},
            "rng": torch.random.get_rng_state(),
            "seed": adapter.spec.seed,
        }

    @staticmethod
    def read_checkpoint_spec(path: str | Path) -> LoraSpec:
        return checkpoint.read_spec(path)[0]

    def load_state(self, adapter_id: str, path: str | Path, include_optimizer: bool,
                   adopt_accumulation: bool = False) -> None:
        """Load weights (and optimizer, scheduler, loss, counters) into an existing adapter.

        Everything is read and rebuilt before the adapter changes, so a failure leaves it as
        it was. With the optimizer, the saved gradient accumulation count must equal the
        adapter's, or the load is refused; `adopt_accumulation` (an adapter created from the
        checkpoint with no count of its own) takes the saved count instead.
        """
        adapter = self._adapter(adapter_id)
        found = checkpoint.read_weights(path)
        tensors = self._peft_tensors(adapter)
        checkpoint.check_shapes({k: v.shape for k, v in tensors.items()}, found)
        restored = None
        if include_optimizer:
            state_file = Path(path) / checkpoint.STATE_FILE
            if not state_file.is_file():
                raise FailedPrecondition("checkpoint: saved without optimizer state; "
                                         "load it without the optimizer")
            restored = self._rebuild(adapter, torch.load(state_file, weights_only=False),
                                     adopt_accumulation)
        with torch.no_grad():
            for key, tensor in tensors.items():
                tensor.copy_(found[key].to(tensor.device, tensor.dtype))
        adapter.zero_grad()
        if restored is not None:
            for field_name, value in restored.items():
                setattr(adapter, field_name, value)

    def _rebuild(self, adapter: Adapter, state: dict[str, Any], adopt_accumulation: bool
                 ) -> dict[str, Any]:
        """The adapter fields a saved training state sets, built without touching it."""
        counters = state["counters"]
        if counters["grad_accum"] != adapter.grad_accum and not adopt_accumulation:
            raise FailedPrecondition(
                f"checkpoint: saved with gradient_accumulation_steps={counters['grad_accum']} "
                f"but this adapter uses {adapter.grad_accum}; load it into an adapter with "
                f"{counters['grad_accum']}, or without the optimizer")
        optimizer = scheduler = None
        optimizer_name, optimizer_kwargs = "", {}
        scheduler_name, scheduler_kwargs = "", {}
        if state["optimizer"] is not None:
            optimizer_name = state["optimizer_name"]
            optimizer_kwargs = dict(state["optimizer_kwargs"])
            if optimizer_name == "AdamW" and not optimizer_kwargs:
                optimizer = optim.make_adamw(adapter.parameters(), AdamParams())
            else:
                optimizer = optim.build_optimizer(optimizer_name, adapter.parameters(),
                                                  **optimizer_kwargs)
            optimizer.load_state_dict(state["optimizer"])
            if state["scheduler"] is not None:
                scheduler_name = state["scheduler_name"]
                scheduler_kwargs = dict(state["scheduler_kwargs"])
                scheduler = optim.build_scheduler(scheduler_name, optimizer, **scheduler_kwargs)
                # Building a scheduler takes its initial step, which rewrites every group's
                # lr (LinearLR: base lr / 3); the saved groups put the resumed lr back.
                optimizer.load_state_dict(state["optimizer"])
                scheduler.load_state_dict(state["scheduler"])
        return {
            "optimizer": optimizer, "optimizer_name": optimizer_name,
            "optimizer_kwargs": optimizer_kwargs, "scheduler": scheduler,
            "scheduler_name": scheduler_name, "scheduler_kwargs": scheduler_kwargs,
            "loss": LossSpec(**state["loss"]) if state["loss"] else adapter.loss,
            "step": counters["step"], "micro_step": counters["micro_step"],
            "tokens_seen": counters["tokens_seen"], "grad_accum": counters["grad_accum"],
        }

    # ------------------------------------------------------------------ sampling

    def _sampling_adapter(self, adapter_id: str | None, weights_path: str | None) -> str | None:
        """The adapter id to route for a request, loading a sampler checkpoint if needed."""
        if adapter_id is not None:
            self._adapter(adapter_id)
            return adapter_id
        if weights_path is None:
            return None
        key = f"sampler:{os.path.realpath(weights_path)}"
        if key in self._samplers:
            self._samplers.move_to_end(key)
            return key
        spec, targets = checkpoint.read_spec(weights_path)
        found = checkpoint.read_weights(weights_path)
        adapter = Adapter(key, spec, self._new_weights(LoraSpec(**{**asdict(spec), "seed": 0}),
                                                       self._targets(spec)))
        tensors = self._peft_tensors(adapter)
        checkpoint.check_shapes({k: v.shape for k, v in tensors.items()}, found)
        with torch.no_grad():
            for k, t in tensors.items():
                t.copy_(found[k].to(t.device, t.dtype))
                t.requires_grad_(False)
        self._attach(adapter)
        self._samplers[key] = adapter
        while len(self._samplers) > _SAMPLER_CACHE_SIZE:
            old_key, old = self._samplers.popitem(last=False)
            self._detach(old_key, old.weights)
        return key

    def sample_batch(self, requests: Sequence[SampleRequest]
                     ) -> list[list[SampledSequence] | EngineError]:
        """Sample every request in one decode batch; failures are per-request values."""
        from twinkle_server.engine import sampler

        results: list[Any] = [None] * len(requests)
        batch, slots = [], []
        for i, request in enumerate(requests):
            try:
                self._check_prompt(request.prompt)
                generation = sampler.GenerationRequest(None, np.asarray(request.prompt),
                                                       request.num_samples, request.params)
                sampler.validate(generation)
                self._check_sample_size(request)
                route_id = self._sampling_adapter(request.adapter_id, request.weights_path)
                batch.append(replace(generation, adapter_id=route_id))
                slots.append(i)
            except EngineError as exc:
                results[i] = exc
        if batch:
            outputs = sampler.generate(self.base.model, self.router.route, batch,
                                       eos_token_ids=self.base.eos_token_ids,
                                       pad_token_id=self.base.pad_token_id,
                                       decode=self.base.decode)
            for slot, out in zip(slots, outputs, strict=True):
                results[slot] = out
        return results

    def _check_sample_size(self, request: SampleRequest) -> None:
        """Bound a sample's compute before it starts: one runaway request would hold the
        only worker, and so every tenant, for as long as it decodes."""
        n, limits = request.prompt.size + request.params.max_tokens, self.limits
        if n > limits.max_seq_len:
            raise InvalidArgument(
                f"sampling_params.max_tokens: prompt ({request.prompt.size} tokens) + "
                f"max_tokens ({request.params.max_tokens}) is over the {limits.max_seq_len}-"
                "token limit (--max-seq-len)")
        if request.num_samples * n > limits.max_batch_tokens:
            raise InvalidArgument(
                f"num_samples: {request.num_samples} x (prompt + max_tokens) = "
                f"{request.num_samples * n} tokens is over the {limits.max_batch_tokens}-token "
                "limit (--max-batch-tokens); use fewer samples or a shorter max_tokens")

    def _check_prompt(self, prompt: np.ndarray) -> None:
        if prompt.size == 0:
            raise InvalidArgument("prompt: is empty")
        if prompt.size > self.limits.max_seq_len:
            raise InvalidArgument(f"prompt: {prompt.size} tokens is over the "
                                  f"{self.limits.max_seq_len}-token limit (--max-seq-len)")
        if prompt.max() >= self.base.vocab_size or prompt.min() < 0:
            raise InvalidArgument(f"prompt: token ids must lie in [0, {self.base.vocab_size})")

    def compute_logprobs(self, adapter_id: str | None, weights_path: str | None,
                         tokens: np.ndarray) -> np.ndarray:
        """Logprob of each token given the ones before it; NaN at position 0."""
        return self.prompt_logprobs(adapter_id, weights_path, tokens).logprobs

    def prompt_logprobs(self, adapter_id: str | None, weights_path: str | None,
                        tokens: np.ndarray, topk: int = 0) -> Any:
        """`compute_logprobs` plus, with `topk` > 0, the top-k tokens at each position
        (a `sampler.PromptLogprobs`)."""
        from twinkle_server.engine import sampler

        self._check_prompt(np.asarray(tokens))
        route_id = self._sampling_adapter(adapter_id, weights_path)
        return sampler.prompt_logprobs(self.base.model, self.router.route, route_id,
                                       np.asarray(tokens), topk)

    def describe(self) -> str:
        return json.dumps({"model": self.base.name, "adapters": len(self.adapters)})


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position: `[T]` targets give `[T]`, `[T, K]` give `[T, K]`."""
    logits, targets = logits.float(), targets.long()
    if targets.ndim == 1:
        return -F.cross_entropy(logits, targets, reduction="none")
    return torch.log_softmax(logits, dim=-1).gather(-1, targets)


def available_memory_bytes(device: torch.device) -> int | None:
    """Free memory for new adapter state on `device` (None when it cannot be read)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
