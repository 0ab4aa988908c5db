"""The static decode batch (`--sampler static`, the baseline the decode pool is measured
against), and what both share with the model: the router's type, the cache keyword, the
idle step of a rank with no rows.

Every request's `num_samples` rows go into one left-padded batch (rows of a request
contiguous, so the multi-LoRA router can give each request its own adapter), and each
step draws every row's token by the one token step (`tokens`): a request gives the same
tokens here as in the pool, alone or beside others.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from twinkle_server.engine import batch_invariant as batch_invariant_mode
from twinkle_server.engine.errors import EngineError
from twinkle_server.engine.sampling import tokens as token_step
from twinkle_server.engine.types import SampledSequence, SampleRequest

Route = Callable[[Sequence[str | None]], AbstractContextManager]


def cache_keyword(model: torch.nn.Module) -> str:
    """transformers renamed `past_key_values` to `cache` (5.2x); use what this one takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forwarding(model: torch.nn.Module, batch_invariant: bool) -> AbstractContextManager:
    """The context a sampling forward of `model` runs in: batch-invariant
    (`engine.batch_invariant.computing`) or as the model is."""
    return batch_invariant_mode.computing(model) if batch_invariant else contextlib.nullcontext()


def idle_step(model: torch.nn.Module, route: Route, pad_token_id: int,
              device: torch.device) -> None:
    """One forward of one padding token on the bare base: a decode step's collectives
    for a rank with nothing left to decode."""
    with route([None]):
        model(input_ids=torch.full((1, 1), pad_token_id, device=device), use_cache=False,
              logits_to_keep=1)


def select_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep only rows `index` of a decode cache, in place: each layer's keys and values
    (transformers' `batch_select_indices`) and a linear-attention or Mamba layer's conv
    and recurrent states, which transformers (5.25) leaves out of that method (a hybrid's
    pure linear-attention layers do not have it at all). Such a layer is known by its two
    state maps (`LinearAttentionCacheLayerMixin` there; older releases have no such
    layers, and the engine refuses hybrids under them: `engine.recurrent.refusal`)."""
    for layer in cache.layers:
        if hasattr(layer, "conv_states") and hasattr(layer, "recurrent_states"):
            for states in (layer.conv_states, layer.recurrent_states):
                for key, value in states.items():
                    if value is None:
                        continue
                    if not isinstance(value, torch.Tensor):
                        raise ValueError("select_rows: a recorded list of recurrent states "
                                         "cannot be selected by row")
                    states[key] = value.index_select(0, index)
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(index)


@torch.inference_mode()
def generate(model: torch.nn.Module, route: Route, requests: Sequence[SampleRequest],
             routes: Sequence[str | None], *, eos_token_ids: Sequence[int], pad_token_id: int,
             decode: Callable[[Sequence[int]], str],
             together: Callable[[bool], bool] | None = None, batch_invariant: bool = False
             ) -> list[list[SampledSequence] | EngineError]:
    """Sample every request's completions in one left-padded, KV-cached batch.

    Args:
        model: a causal LM; every forward runs inside `route(row_route_ids)`.
        route: the multi-LoRA router; row i of each forward uses route id i.
        requests: checked requests; rows of request r are contiguous, in request order.
        routes: the route id of each request (None: the base).
        eos_token_ids: stop tokens for requests without `ignore_eos`.
        pad_token_id: left-padding id (masked out, never attended to).
        decode: token ids -> text, for stop strings.
        together: on several ranks, each sampling its own share of a batch: called
            before every step with whether this rank still has rows, it answers whether
            any rank has; a rank out of rows runs a one-token forward each step until
            every rank is done, since each forward gathers the sharded base's layers.
        batch_invariant: run every forward batch-invariant (`engine.batch_invariant`).

    Returns:
        Per request, its `num_samples` `SampledSequence`s, or the `EngineError` it alone
        failed with (logits that are not finite). Rows that finish leave the batch.
    """
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
    generators = [token_step.new_generator(r.params.seed, device) for r in requests]
    stops = [token_step.stop_tokens(r.params, eos_token_ids) for r in requests]
    failed: list[EngineError | None] = [None] * len(requests)
    out_tokens: list[list[int]] = [[] for _ in owners]
    out_logprobs: list[list[float]] = [[] for _ in owners]
    out_topk: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in owners]
    stopped: list[token_step.Stop | None] = [None] * len(owners)
    active = list(range(len(owners)))  # global row index of each batch row, in order
    cache_kw = cache_keyword(model)
    cache = None
    step_input, positions = ids, (mask.cumsum(-1) - 1).clamp(min=0)
    while active if together is None else together(bool(active)):
        if not active:
            idle_step(model, route, pad_token_id, device)
            continue
        with route([routes[owners[row]] for row in active]), forwarding(model, batch_invariant):
            out = model(input_ids=step_input, attention_mask=mask, position_ids=positions,
                        use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        cache = getattr(out, cache_kw)
        segments, start = [], 0
        while start < len(active):  # one contiguous segment per request, in request order
            owner, end = owners[active[start]], start
            while end < len(active) and owners[active[end]] == owner:
                end += 1
            segments.append(token_step.Segment(range(start, end), requests[owner].params,
                                               generators[owner]))
            start = end
        drawn = token_step.draw(out.logits[:, -1].float(), segments,
                                max(requests[owners[row]].topk_logprobs for row in active))
        keep = []
        for batch_row, row in enumerate(active):
            owner = owners[row]
            if not drawn.finite(batch_row):
                failed[owner] = failed[owner] or token_step.not_finite(requests[owner])
            if failed[owner] is not None:
                continue
            out_tokens[row].append(drawn.tokens[batch_row])
            out_logprobs[row].append(drawn.logprobs[batch_row])
            if k := requests[owner].topk_logprobs:
                out_topk[row].append((drawn.top_ids[batch_row, :k],  # type: ignore[index]
                                      drawn.top_logprobs[batch_row, :k]))  # type: ignore[index]
            stopped[row] = token_step.stop_reason(out_tokens[row], requests[owner].params,
                                                  stops[owner], decode)
            if stopped[row] is None:
                keep.append(batch_row)
        # A request that failed on a later row drops the rows it kept before.
        keep = [b for b in keep if failed[owners[active[b]]] is None]
        chosen = drawn.chosen
        if len(keep) < len(active):
            index = torch.tensor(keep, dtype=torch.long, device=device)
            select_rows(cache, index)
            chosen, mask, positions = chosen[index], mask[index], positions[index]
            active = [active[i] for i in keep]
        step_input = chosen[:, None]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        positions = positions[:, -1:] + 1
    results: list[list[SampledSequence] | EngineError] = [
        error if error is not None else [] for error in failed]
    for row, owner in enumerate(owners):
        if failed[owner] is None:
            results[owner].append(token_step.sequence(  # type: ignore[union-attr]
                out_tokens[row], out_logprobs[row], out_topk[row],
                requests[owner].topk_logprobs, stopped[row]))
    return results
