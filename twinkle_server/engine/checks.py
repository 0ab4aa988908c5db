"""Checks of a request against the engine's limits and vocabulary, before any compute.

Each reads only the request, the limits (`EngineLimits`, the server's flags) and the
vocabulary size, never adapter state, and raises `InvalidArgument` naming the field and
the limit; the engine runs them before it touches the base, and the runtime and the
fronts run them before anything is queued (this is one of the engine's public modules).
The checks of the prompt-scoring options live beside the scoring and are re-exported
here, as `prompt_scoring` and `topk`, so that every request check is found in this one
module.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from twinkle_server.engine import losses
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.prompt_scoring import check as prompt_scoring
from twinkle_server.engine.prompt_scoring import check_topk as topk
from twinkle_server.engine.types import EngineLimits, ForwardRequest, LoraSpec, SampleRequest

__all__ = ["batch_tokens", "forward_request", "lora_scaling", "lora_spec", "prompt",
           "prompt_scoring", "sample_size", "sampling", "topk"]


def lora_spec(spec: LoraSpec, limits: EngineLimits) -> None:
    """A new adapter's rank within `--max-rank`, finite alpha and dropout in [0, 1)."""
    if not 1 <= spec.rank <= limits.max_rank:
        raise InvalidArgument(
            f"lora.rank: {spec.rank} is outside [1, {limits.max_rank}] (--max-rank)")
    for name in ("alpha", "dropout"):
        if not math.isfinite(getattr(spec, name)):
            raise InvalidArgument(f"lora.{name}: must be finite")
    if not 0.0 <= spec.dropout < 1.0:
        raise InvalidArgument(f"lora.dropout: {spec.dropout} is outside [0, 1)")
    lora_scaling(spec, "lora.alpha")


def lora_scaling(spec: LoraSpec, where: str) -> None:
    """The adapter's scaling (alpha over rank, or its root) within float32, the dtype
    every adapter product scales in: beyond it a forward fails outright, and a merged
    pass or decode step fails with it every tenant beside."""
    limit = float(torch.finfo(torch.float32).max)
    if not abs(spec.scaling) <= limit:
        raise InvalidArgument(f"{where}: {spec.alpha:g} makes the scaling {spec.scaling:g}, "
                              f"beyond float32's {limit:.3g}")


def forward_request(request: ForwardRequest, limits: EngineLimits, vocab: int) -> None:
    """A forward batch: non-empty sequences within `--max-seq-len`, ids in the
    vocabulary, loss inputs as long as their sequence, the batch within
    `--max-batch-tokens`, and the request's own loss (when it names one) valid."""
    if not request.datums:
        raise InvalidArgument("data: the batch is empty")
    total = 0
    for index, datum in enumerate(request.datums):
        n = datum.num_tokens
        if n == 0:
            raise InvalidArgument(f"datum[{index}].input_ids: the sequence is empty")
        if n > limits.max_seq_len:
            raise InvalidArgument(f"datum[{index}].input_ids: {n} tokens is over the "
                                  f"{limits.max_seq_len}-token limit (--max-seq-len)")
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
    batch_tokens(total, limits)
    if request.loss is not None:
        losses.validate_loss(request.loss, request.datums)


def batch_tokens(total: int, limits: EngineLimits) -> None:
    """A forward batch's `total` tokens within `--max-batch-tokens`: checked on the whole
    request here, and on a running count by the fronts while they decode one, so a batch
    far over the limit is refused before all of it is held."""
    if total > limits.max_batch_tokens:
        raise InvalidArgument(f"data: more than {limits.max_batch_tokens} tokens in one "
                              f"request ({total} so far; --max-batch-tokens); split the "
                              "batch")


def sampling(request: SampleRequest) -> None:
    """A sample request's own fields, each in range (the engine's one check of them; the
    fronts check the wire's forms, not these ranges again)."""
    p = request.params
    if request.num_samples < 1:
        raise InvalidArgument(f"num_samples: must be >= 1, got {request.num_samples}")
    if p.max_tokens < 1:
        raise InvalidArgument(f"sampling_params.max_tokens: must be >= 1, got {p.max_tokens}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidArgument(f"sampling_params.temperature: must be finite and >= 0, "
                              f"got {p.temperature}")
    if not (0.0 < p.top_p <= 1.0):
        raise InvalidArgument(f"sampling_params.top_p: must be in (0, 1], got {p.top_p}")
    # -1 is Tinker's default for "no limit" (its SDK sends it unchanged), so it means off
    # like 0; anything lower is a mistake.
    if p.top_k < -1:
        raise InvalidArgument(f"sampling_params.top_k: must be >= 0 (or -1 = no limit), "
                              f"got {p.top_k}")
    topk(request.topk_logprobs, "topk_sample_logprobs")


def sample_size(request: SampleRequest, limits: EngineLimits) -> None:
    """Bound a sample's compute before it starts: one runaway request would hold the
    only worker, and so every tenant, for as long as it decodes."""
    n = request.prompt.size + request.params.max_tokens
    if n > limits.max_seq_len:
        raise InvalidArgument(
            f"sampling_params.max_tokens: prompt ({request.prompt.size} tokens) + "
            f"max_tokens ({request.params.max_tokens}) is over the {limits.max_seq_len}-"
            "token limit (--max-seq-len)")
    if request.num_tokens > limits.max_batch_tokens:
        raise InvalidArgument(
            f"num_samples: {request.num_samples} x (prompt + max_tokens) = "
            f"{request.num_tokens} tokens is over the {limits.max_batch_tokens}-token "
            "limit (--max-batch-tokens); use fewer samples or a shorter max_tokens")


def prompt(tokens: np.ndarray, limits: EngineLimits, vocab: int) -> None:
    """A prompt to sample from or score: non-empty, within `--max-seq-len`, ids in the
    vocabulary."""
    if tokens.size == 0:
        raise InvalidArgument("prompt: is empty")
    if tokens.size > limits.max_seq_len:
        raise InvalidArgument(f"prompt: {tokens.size} tokens is over the "
                              f"{limits.max_seq_len}-token limit (--max-seq-len)")
    if tokens.max() >= vocab or tokens.min() < 0:
        raise InvalidArgument(f"prompt: token ids must lie in [0, {vocab})")
