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

from twinkle_server.engine.base_model import last_hidden_states
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.logprobs import OutputHead, top_logprobs
from twinkle_server.engine.types import SampledSequence, SamplingParams

Route = Callable[[Sequence[str | None]], AbstractContextManager]


@dataclass(frozen=True)
class GenerationRequest:
    """`num_samples` completions of one int64 `[T]` prompt under one adapter (None = base)."""

    adapter_id: str | None
    prompt: np.ndarray
    num_samples: int
    params: SamplingParams


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


def _pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
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


def _cache_keyword(model: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use what this one takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _generator(seed: int | None, device: torch.device) -> torch.Generator:
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
        eos_token_ids: stop tokens for requests with `stop_on_eos`.
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
            _idle_step(model, route, pad_token_id, device)
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
    generators = [_generator(r.params.seed, device) for r in requests]
    stops = [set(r.params.stop_token_ids) | (set(eos_token_ids) if r.params.stop_on_eos else set())
             for r in requests]
    out_tokens: list[list[int]] = [[] for _ in owners]
    out_logprobs: list[list[float]] = [[] for _ in owners]
    reasons: list[str | None] = [None] * len(owners)
    active = list(range(len(owners)))  # global row index of each batch row, in order
    cache_kw = _cache_keyword(model)
    cache = None
    step_input, positions = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    while active if together is None else together(bool(active)):
        if not active:
            _idle_step(model, route, pad_token_id, device)
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
            chosen[start:end] = _pick(logits[start:end], requests[owner].params,
                                      generators[owner])
            start = end
        chosen_logp = torch.log_softmax(logits, dim=-1).gather(-1, chosen[:, None]).squeeze(-1)
        chosen_list, logp_list = chosen.tolist(), chosen_logp.tolist()
        keep = []
        for batch_row, row in enumerate(active):
            params = requests[owners[row]].params
            token = chosen_list[batch_row]
            out_tokens[row].append(token)
            out_logprobs[row].append(logp_list[batch_row])
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
        results[owner].append(SampledSequence(
            tokens=np.asarray(out_tokens[row], dtype=np.int32),
            logprobs=np.asarray(out_logprobs[row], dtype=np.float32),
            stop_reason=reasons[row]))
    return results


def _idle_step(model: torch.nn.Module, route: Route, pad_token_id: int,
               device: torch.device) -> None:
    """One forward of one padding token on the bare base: a decode step's collectives
    for a rank with nothing left to decode."""
    with route([None]):
        model(input_ids=torch.full((1, 1), pad_token_id, device=device), use_cache=False,
              logits_to_keep=1)


MAX_TOPK = 20
"""Most top-k prompt alternatives one request may ask for (Tinker's own cap)."""
TOPK_MASK_LOGPROB = -99999.0
"""Logprob of the filler at position 0, which has no context (Tinker's sentinel)."""


@dataclass(frozen=True)
class PromptLogprobs:
    """Per prompt position t: logprob of token t given tokens[:t] (NaN at 0), and with
    k > 0 the k most likely tokens there with their logprobs, most likely first (row 0 is
    token 0 / `TOPK_MASK_LOGPROB`)."""

    logprobs: np.ndarray                   # float32 [T]
    topk_token_ids: np.ndarray | None      # int32 [T, k]
    topk_logprobs: np.ndarray | None       # float32 [T, k]


def check_topk(topk: int) -> None:
    """Raise `InvalidArgument` unless 0 <= topk <= MAX_TOPK."""
    if not 0 <= topk <= MAX_TOPK:
        raise InvalidArgument(f"topk_prompt_logprobs: must be in [0, {MAX_TOPK}], got {topk}")


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, route: Route, adapter_id: str | None,
                    tokens: np.ndarray, topk: int = 0) -> PromptLogprobs:
    """Prompt logprobs in one teacher-forced pass (see `PromptLogprobs`).

    The logits come a chunk of positions at a time from the last hidden states
    (`logprobs.top_logprobs`): a 4,096-token prompt's whole `[T x V]` float32 logits and
    log-softmax would be 2 x 2.3 GiB with a 151,936-token vocabulary.
    """
    check_topk(topk)
    device = next(model.parameters()).device
    ids = torch.from_numpy(np.asarray(tokens, dtype=np.int64))[None].to(device)
    with route([adapter_id]):
        hidden = last_hidden_states(model, input_ids=ids, use_cache=False)[0, :-1]
        own, values, indices = top_logprobs(OutputHead.of(model), hidden, ids[0, 1:], topk)
    out = np.concatenate([[np.nan], own.cpu().numpy()]).astype(np.float32)
    if topk == 0:
        return PromptLogprobs(out, None, None)
    top_ids = np.zeros((len(out), topk), np.int32)
    top_lps = np.full((len(out), topk), TOPK_MASK_LOGPROB, np.float32)
    top_ids[1:, :indices.shape[-1]] = indices.cpu().numpy()
    top_lps[1:, :values.shape[-1]] = values.cpu().numpy()
    return PromptLogprobs(out, top_ids, top_lps)
