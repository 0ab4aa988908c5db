"""The engine's decode loop: one KV-cached batch for the samples of many requests.

Every request's `num_samples` rows go into one left-padded batch (rows of a request
contiguous, so the multi-LoRA router can give each request its own adapter). Each
request draws from its own `torch.Generator`, so the same request and seed give the
same tokens whether it is sampled alone or beside others.

Returned logprobs are those of the sampled tokens under the model's untempered
distribution (log-softmax of the raw logits), i.e. what a teacher-forced forward of
prompt + completion gives; RL losses use them as `old_logp`.
"""

from __future__ import annotations

import inspect
import math
import secrets
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import SampledSequence, SamplingParams

Route = Callable[[Sequence[str | None]], AbstractContextManager]


@dataclass(frozen=True)
class GenerationRequest:
    adapter_id: str | None
    prompt: np.ndarray
    num_samples: int
    params: SamplingParams


def validate(request: GenerationRequest) -> None:
    p = request.params
    if request.prompt.size == 0:
        raise InvalidArgument("prompt: is empty")
    if request.num_samples < 1:
        raise InvalidArgument(f"num_samples: must be >= 1, got {request.num_samples}")
    if p.max_tokens < 1:
        raise InvalidArgument(f"sampling_params.max_tokens: must be >= 1, got {p.max_tokens}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidArgument(f"sampling_params.temperature: must be finite and >= 0, "
                              f"got {p.temperature}")
    if not (0.0 < p.top_p <= 1.0):
        raise InvalidArgument(f"sampling_params.top_p: must be in (0, 1], got {p.top_p}")


def _pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
          ) -> torch.Tensor:
    """Choose one token per row of `logits` [n, V] under the request's parameters."""
    if params.temperature == 0 or params.top_k == 1:
        return logits.argmax(-1)
    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        ordered = ordered.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


def _cache_keyword(model: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use what this one takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.inference_mode()
def generate(model: torch.nn.Module, route: Route, requests: Sequence[GenerationRequest], *,
             eos_token_ids: Sequence[int], pad_token_id: int,
             decode: Callable[[Sequence[int]], str]) -> list[list[SampledSequence]]:
    """Sample every request's completions in one batch; results in request order."""
    for request in requests:
        validate(request)
    device = next(model.parameters()).device
    owners = [i for i, r in enumerate(requests) for _ in range(r.num_samples)]
    row_ids = [requests[i].adapter_id for i in owners]
    prompts = [np.asarray(requests[i].prompt, dtype=np.int64) for i in owners]
    width = max(p.size for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.size:] = torch.from_numpy(prompt)
        mask[row, width - prompt.size:] = 1
    ids, mask = ids.to(device), mask.to(device)
    generators = [torch.Generator().manual_seed(
        r.params.seed if r.params.seed is not None else secrets.randbits(63)) for r in requests]
    stops = [set(r.params.stop_token_ids) | (set(eos_token_ids) if r.params.stop_on_eos else set())
             for r in requests]
    out_tokens: list[list[int]] = [[] for _ in owners]
    out_logprobs: list[list[float]] = [[] for _ in owners]
    reasons: list[str | None] = [None] * len(owners)
    steps = max(r.params.max_tokens for r in requests)
    cache_kw = _cache_keyword(model)
    cache = None
    step_input, positions = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    for _ in range(steps):
        with route(row_ids):
            out = model(input_ids=step_input, attention_mask=mask, position_ids=positions,
                        use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        cache = getattr(out, cache_kw)
        logits = out.logits[:, -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        chosen = torch.empty(len(owners), dtype=torch.long, device=device)
        start = 0
        for i, request in enumerate(requests):
            end = start + request.num_samples
            chosen[start:end] = _pick(logits[start:end], request.params, generators[i])
            start = end
        chosen_logp = logp.gather(-1, chosen[:, None]).squeeze(-1).cpu().tolist()
        chosen_list = chosen.cpu().tolist()
        for row, owner in enumerate(owners):
            if reasons[row] is not None:
                continue
            params = requests[owner].params
            out_tokens[row].append(chosen_list[row])
            out_logprobs[row].append(chosen_logp[row])
            if chosen_list[row] in stops[owner]:
                reasons[row] = "stop"
            elif params.stop_strings and any(s in decode(out_tokens[row])
                                              for s in params.stop_strings):
                reasons[row] = "stop"
            elif len(out_tokens[row]) >= params.max_tokens:
                reasons[row] = "length"
        if all(r is not None for r in reasons):
            break
        step_input = chosen[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        positions = positions[:, -1:] + 1
    results: list[list[SampledSequence]] = [[] for _ in requests]
    for row, owner in enumerate(owners):
        results[owner].append(SampledSequence(
            tokens=np.asarray(out_tokens[row], dtype=np.int32),
            logprobs=np.asarray(out_logprobs[row], dtype=np.float32),
            stop_reason=reasons[row] or "length"))
    return results


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, route: Route, adapter_id: str | None,
                    tokens: np.ndarray) -> np.ndarray:
    """float32 `[T]`: logprob of token t given tokens[:t]; NaN at position 0."""
    device = next(model.parameters()).device
    ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None].to(device)
    with route([adapter_id]):
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return np.concatenate([[np.nan], lp.cpu().numpy()]).astype(np.float32)
