"""The engine's training verbs: merged forward passes, the optimizer verbs, checkpoints.

`Training` is the half of `Engine` (`engine.engine`) that runs requests on adapters it
already holds: the checks before a pass and the merged pass itself (`engine.forward`),
the optimizer verbs (on `Adapter`), and PEFT save and load (`engine.checkpoint`).
Creating, sizing and removing adapters, and loading the base, stay in `engine.engine`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twinkle_server.engine import checkpoint, checks, forward, losses
from twinkle_server.engine.adapter import Adapter
from twinkle_server.engine.base_model import BaseModel
from twinkle_server.engine.errors import (
    EngineError,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
)
from twinkle_server.engine.lora import Router
from twinkle_server.engine.memory import OUT_OF_MEMORY
from twinkle_server.engine.parallel import Parallel
from twinkle_server.engine.protocol import rank_zero_only, replicated
from twinkle_server.engine.types import (
    AdamParams,
    EngineLimits,
    ForwardOutput,
    ForwardRequest,
    LoraSpec,
    LossSpec,
)

log = logging.getLogger(__name__)


class Training:
    """The training verbs of `Engine`, over the state `Engine` builds (the attributes
    below); not used alone."""

    base: BaseModel
    limits: EngineLimits
    router: Router
    adapters: dict[str, Adapter]
    packing: bool
    parallel: Parallel

    def _known(self, adapter_id: str) -> Adapter:
        """The adapter, resident or paged out (`engine.residency`)."""
        if adapter_id not in self.adapters:
            raise NotFound(f"model_id: no model {adapter_id!r}")
        return self.adapters[adapter_id]

    def _adapter(self, adapter_id: str) -> Adapter:
        """The adapter, paged in first if it was out: what every verb that uses it
        reads."""
        adapter = self._known(adapter_id)
        self._make_resident(adapter_id)   # type: ignore[attr-defined]
        return adapter

    # ------------------------------------------------------------------ forward

    @rank_zero_only
    def check_forward(self, request: ForwardRequest) -> None:
        """The checks that depend only on the request, the limits and the vocabulary
        (`checks.forward_request`). They read no adapter state, so a front may run them
        as soon as a request arrives (a bad batch then fails before it queues);
        `forward_batch` runs them again with the checks against the adapter, in the
        adapter's op order."""
        checks.forward_request(request, self.limits, self.base.vocab_size)

    @rank_zero_only
    def validate_forward(self, request: ForwardRequest) -> LossSpec:
        """Every check before compute, each naming the field and the limit; returns the
        loss the request runs with (its own, or the adapter's from `set_loss`).

        Reads the adapter, so it belongs on the worker, in the adapter's op order: a
        `set_loss` queued just before this request has run by then.
        """
        adapter = self._known(request.adapter_id)   # its loss: no page-in for that
        self.check_forward(request)
        if request.loss is not None:
            return request.loss
        if adapter.loss is None:
            raise FailedPrecondition("loss_fn: none given and none set with set_loss")
        losses.validate_loss(adapter.loss, request.datums)
        return adapter.loss

    @replicated
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
        for chunk in _resident_chunks(valid, requests, self.limits.max_adapters):
            run = [requests[i] for i in chunk]
            try:
                with self._hold(r.adapter_id for r in run):   # type: ignore[attr-defined]
                    outputs: Sequence[ForwardOutput | EngineError] = forward.run_forward(
                        self.base, self.router, self.adapters, run, self.packing,
                        self.parallel, self.limits.max_pass_tokens)
            except ResourceExhausted as exc:
                outputs = [exc] * len(run)
            except OUT_OF_MEMORY as exc:
                tokens = sum(d.num_tokens for request in run for d in request.datums)
                cap = self.limits.max_pass_tokens
                outputs = [self._out_of_memory(
                    f"a pass of {len(run)} requests, {tokens} tokens",
                    f"--max-pass-tokens (now {cap or 'none'})", exc)] * len(run)
            for i, output in zip(chunk, outputs, strict=True):
                results[i] = output
        self.heap.after_pass()   # type: ignore[attr-defined]
        return results  # type: ignore[return-value]

    def _out_of_memory(self, what: str, remedy: str, exc: BaseException
                       ) -> ResourceExhausted:
        """The error a pass or decode batch that ran the device (or host) out of memory
        fails its requests with, in one process. Nothing was applied: a failed pass leaves
        every gradient and counter as it was (`forward`). On several ranks the error is
        raised instead: one rank's failure leaves the others waiting in a collective, so
        the group is lost (`twinkle_server.ranks.replication`)."""
        if self.parallel.world > 1:
            raise exc
        log.warning("out of memory in %s: %s", what, exc)
        return ResourceExhausted(
            f"memory: the {self.base.device.type} device ran out of memory in {what}; "
            f"nothing was applied. Retry with fewer tokens, or restart the server with a "
            f"lower {remedy}")

    # ------------------------------------------------------------------ optimizer verbs

    @replicated
    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]:
        """Tinker's step: AdamW with exactly `params`, optional clipping, zero the grads."""
        return self._adapter(adapter_id).optim_step(params)

    @replicated
    def set_loss(self, adapter_id: str, loss: LossSpec) -> None:
        """The adapter's native loss, used by requests that name none."""
        losses.resolve_config(loss)
        self._adapter(adapter_id).loss = loss

    @replicated
    def set_optimizer(self, adapter_id: str, name: str, kwargs: dict[str, Any]) -> None:
        """Replace the adapter's optimizer with an allow-listed one (`optim.OPTIMIZERS`)."""
        self._adapter(adapter_id).set_optimizer(name, kwargs)

    @replicated
    def set_lr_scheduler(self, adapter_id: str, name: str, kwargs: dict[str, Any]) -> None:
        """Schedule the adapter's lr with an allow-listed scheduler (`optim.SCHEDULERS`)."""
        self._adapter(adapter_id).set_lr_scheduler(name, kwargs)

    @replicated
    def clip_grad_norm(self, adapter_id: str, max_norm: float) -> float:
        """Clip at an accumulation boundary; returns the norm before clipping."""
        return self._adapter(adapter_id).clip_grad_norm(max_norm)

    @replicated
    def step(self, adapter_id: str) -> dict[str, float]:
        """Count a micro-step; every `grad_accum`-th one applies the optimizer."""
        return self._adapter(adapter_id).step_optimizer()

    @replicated
    def zero_grad(self, adapter_id: str) -> None:
        """Clear the gradients at an accumulation boundary (kept inside a window)."""
        self._adapter(adapter_id).zero_grad_at_boundary()

    @replicated
    def lr_step(self, adapter_id: str) -> None:
        """Advance the scheduler once per applied optimizer step."""
        self._adapter(adapter_id).lr_step()

    @replicated
    def calculate_metric(self, adapter_id: str, is_training: bool = True) -> dict[str, float]:
        """Averages since the last call (then reset), plus the adapter's counters."""
        return self._adapter(adapter_id).calculate_metric(is_training)

    @rank_zero_only
    def get_train_configs(self, adapter_id: str) -> dict[str, Any]:
        """LoRA shape, optimizer, scheduler, loss and counters, as plain values."""
        return self._adapter(adapter_id).train_configs()

    # ------------------------------------------------------------------ checkpoints

    @rank_zero_only
    def save_weights(self, adapter_id: str, path: str | Path, overwrite: bool = False) -> int:
        """PEFT weights only (a sampler checkpoint); returns bytes written."""
        return checkpoint.save_weights(self._adapter(adapter_id), path,
                                       str(self.base.model_dir), overwrite)

    @rank_zero_only
    def save_state(self, adapter_id: str, path: str | Path, include_optimizer: bool = True,
                   overwrite: bool = False) -> int:
        """PEFT weights plus, with `include_optimizer`, everything needed to resume exactly."""
        return checkpoint.save_state(self._adapter(adapter_id), path, str(self.base.model_dir),
                                     include_optimizer, overwrite)

    @rank_zero_only
    @staticmethod
    def read_checkpoint_spec(path: str | Path) -> LoraSpec:
        """The LoRA shape a checkpoint was saved with (to create an adapter to load it)."""
        return checkpoint.read_spec(path)[0]

    @replicated
    def load_state(self, adapter_id: str, path: str | Path, include_optimizer: bool,
                   adopt_accumulation: bool = False) -> None:
        """Load weights (and optimizer, scheduler, loss, counters) into an existing adapter;
        all or nothing (see `checkpoint.load_state`)."""
        checkpoint.load_state(self._adapter(adapter_id), path, include_optimizer,
                              adopt_accumulation)


def _resident_chunks(valid: list[int], requests: Sequence[ForwardRequest],
                     most: int) -> list[list[int]]:
    """`valid` (indices of `requests`) in passes of at most `most` adapters each, in
    order: a merged pass needs each of its adapters resident at once (`--max-adapters`).
    One pass whenever they fit, as before residency."""
    chunks: list[list[int]] = []
    adapters: set[str] = set()
    for i in valid:
        adapter = requests[i].adapter_id
        if not chunks or (adapter not in adapters and len(adapters) == most):
            chunks.append([])
            adapters = set()
        chunks[-1].append(i)
        adapters.add(adapter)
    return chunks
