"""The static decode batch (`--sampler static`, the baseline continuous batching in
`engine.decoding` is measured against) and the rules both share: request checks, token
picking, seeded generators, top-k arrays, the idle step of a rank with no rows.

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
from twinkle_server.engine.prompt_scoring import (  # noqa: F401  (re-exported)
    MAX_TOPK,
    TOPK_MASK_LOGPROB,
    PromptLogprobs,
    PromptScoring,
    check_topk,
    score_prompt,
)
from twinkle_server.engine.types import SampledSequence, SamplingParams

Route = Callable[[Sequence[str | None]], AbstractContextManager]


@dataclass(frozen=True)
class GenerationRequest:
    """`num_samples` completions of one int64 `[T]` prompt under one adapter (None = base);
    `topk_logprobs` k > 0 also returns the k likeliest tokens at every sampled position."""

    adapter_id: str | None
    prompt: np.ndarray
    num_samples: int
    params: SamplingParams
    topk_logprobs: int = 0


def validate(request: GenerationRequest) -> None:
    """Raise `InvalidArgument` naming the field and its limit; the engine may call this per
    request first so that one bad request does not fail the whole batch."""
    p = request.params
    if np.asarray(request.prompt).size == 0:
        raise InvalidArgument("prompt: is empty (needs >= 1 token)")
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
    check_topk(request.topk_logprobs, "topk_sample_logprobs")


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
          ) -> torch.Tensor:
    """Choose one token per row of `logits` [n, V] under the request's parameters."""
    if params.temperature == 0 or params.top_k == 1:
        return logits.argmax(-1)
    scores = logits / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        # topk returns its values sorted, so top-p below sorts only k columns, not V.
        ordered, order = torch.topk(scores, params.top_k, dim=-1)
    elif params.top_p < 1.0:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
    else:
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if params.top_p < 1.0:
        probs = torch.softmax(ordered, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        ordered = ordered.masked_fill(drop, float("-inf"))
    pick = torch.multinomial(torch.softmax(ordered, dim=-1), 1, generator=generator)
    return order.gather(-1, pick).squeeze(-1)


def cache_keyword(model: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use what this one takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """One stream per request, on the logits' device so sampling copies nothing to the host."""
    return torch.Generator(device=device).manual_seed(
        seed if seed is not None else secrets.randbits(63))


@torch.inference_mode()
def generate(model: torch.nn.Module, route: Route, requests: Sequence[GenerationRequest], *,
             eos_token_ids: Sequence[int], pad_token_id: int,
             decode: Callable[[Sequence[int]], str],
             together: Callable[[bool], bool] | None = None) -> list[list[SampledSequence]]:
    """Sample every request's completions in one left-padded, KV-cached batch.

    Args:
        model: a causal LM; every forward runs inside `route(row_adapter_ids)`.
        route: the multi-LoRA router; row i of each forward uses adapter ids[i].
        requests: rows of request r are contiguous, in request order.
        eos_token_ids: stop tokens for requests without `ignore_eos`.
        pad_token_id: left-padding id (masked out, never attended to).
        decode: token ids -> text, for stop strings.

    Returns:
        Per request, its `num_samples` `SampledSequence`s (int32 tokens, float32 untempered
        logprobs, 'stop' or 'length').

    Raises:
        InvalidArgument: a request's field is out of range (checked before any compute).

    Rows that finish leave the batch (and the KV cache), so later steps only pay for the
    rows still decoding.

    `together` (several ranks, each sampling its own share of a batch): called before
    every step with whether this rank still has rows, it answers whether any rank has;
    a rank out of rows (or with none) runs a one-token forward each step until every
    rank is done, since each forward gathers the sharded base's layers with the others.
    """
    for request in requests:
        validate(request)
    device = next(model.parameters()).device
    if not requests:
        while together is not None and together(False):
            idle_step(model, route, pad_token_id, device)
        return []
    owners = [i for i, r in enumerate(requests) for _ in range(r.num_samples)]
    prompts = [np.asarray(requests[i].prompt, dtype=np.int64) for i in owners]
    width = max(p.size for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.size:] = torch.from_numpy(prompt)
        mask[row, width - prompt.size:] = 1
    ids, mask = ids.to(device), mask.to(device)
    generators = [new_generator(r.params.seed, device) for r in requests]
    stops = [set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(eos_token_ids))
             for r in requests]
    out_tokens: list[list[int]] = [[] for _ in owners]
    out_logprobs: list[list[float]] = [[] for _ in owners]
    # Per row, per step: the (ids, logprobs) of its request's top-k, when it asks.
    out_topk: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in owners]
    reasons: list[str | None] = [None] * len(owners)
    active = list(range(len(owners)))  # global row index of each batch row, in order
    cache_kw = cache_keyword(model)
    cache = None
    step_input, positions = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    while active if together is None else together(bool(active)):
        if not active:
            idle_step(model, route, pad_token_id, device)
            continue
        with route([requests[owners[row]].adapter_id for row in active]):
            out = model(input_ids=step_input, attention_mask=mask, position_ids=positions,
                        use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        cache = getattr(out, cache_kw)
        logits = out.logits[:, -1].float()
        chosen = torch.empty(len(active), dtype=torch.long, device=device)
        start = 0
        while start < len(active):  # one contiguous segment per request, in request order
            owner = owners[active[start]]
            end = start
            while end < len(active) and owners[active[end]] == owner:
                end += 1
            chosen[start:end] = pick(logits[start:end], requests[owner].params,
                                      generators[owner])
            start = end
        logp = torch.log_softmax(logits, dim=-1)
        chosen_logp = logp.gather(-1, chosen[:, None]).squeeze(-1)
        chosen_list, logp_list = chosen.tolist(), chosen_logp.tolist()
        widest = max(requests[owners[row]].topk_logprobs for row in active)
        if widest:  # one top-k for the batch, as wide as its widest request's
            top = torch.topk(logp, min(widest, logp.shape[-1]), dim=-1)
            top_ids, top_lps = top.indices.cpu().numpy(), top.values.cpu().numpy()
        keep = []
        for batch_row, row in enumerate(active):
            params = requests[owners[row]].params
            token = chosen_list[batch_row]
            out_tokens[row].append(token)
            out_logprobs[row].append(logp_list[batch_row])
            if k := requests[owners[row]].topk_logprobs:
                out_topk[row].append((top_ids[batch_row, :k], top_lps[batch_row, :k]))
            if token in stops[owners[row]]:
                reasons[row] = "stop"
            elif params.stop_strings and any(s in decode(out_tokens[row])
                                              for s in params.stop_strings):
                reasons[row] = "stop"
            elif len(out_tokens[row]) >= params.max_tokens:
                reasons[row] = "length"
            else:
                keep.append(batch_row)
        if len(keep) < len(active):
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            chosen, mask, positions = chosen[index], mask[index], positions[index]
            active = [active[i] for i in keep]
        step_input = chosen[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        positions = positions[:, -1:] + 1
    results: list[list[SampledSequence]] = [[] for _ in requests]
    for row, owner in enumerate(owners):
        topk = topk_arrays(out_topk[row], requests[owner].topk_logprobs)
        results[owner].append(SampledSequence(
            tokens=np.asarray(out_tokens[row], dtype=np.int32),
            logprobs=np.asarray(out_logprobs[row], dtype=np.float32),
            stop_reason=reasons[row], topk_token_ids=topk[0], topk_logprobs=topk[1]))
    return results


def topk_arrays(steps: list[tuple[np.ndarray, np.ndarray]], k: int
                 ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """A row's per-step top-k as int32 / float32 `[n, k]` (None when not asked); a
    vocabulary narrower than k leaves token 0 / `TOPK_MASK_LOGPROB` in the last columns."""
    if not k:
        return None, None
    ids = np.zeros((len(steps), k), np.int32)
    lps = np.full((len(steps), k), TOPK_MASK_LOGPROB, np.float32)
    for i, (step_ids, step_lps) in enumerate(steps):
        ids[i, :step_ids.size] = step_ids
        lps[i, :step_lps.size] = step_lps
    return ids, lps


def idle_step(model: torch.nn.Module, route: Route, pad_token_id: int,
               device: torch.device) -> None:
    """One forward of one padding token on the bare base: a decode step's collectives
    for a rank with nothing left to decode."""
    with route([None]):
        model(input_ids=torch.full((1, 1), pad_token_id, device=device), use_cache=False,
              logits_to_keep=1)


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, route: Route, adapter_id: str | None,
                    tokens: np.ndarray, topk: int = 0) -> PromptLogprobs:
    """Every prompt position's own logprob (NaN at 0) and, with `topk` > 0, its top-k, in
    one teacher-forced pass: `prompt_scoring.score_prompt` with nothing else asked.

    The logits come a chunk of positions at a time from the last hidden states: a
    4,096-token prompt's whole `[T x V]` float32 logits and log-softmax would be
    2 x 2.3 GiB with a 151,936-token vocabulary.
    """
    return score_prompt(model, route, adapter_id, tokens, PromptScoring(include=True,
                                                                        topk=topk))
