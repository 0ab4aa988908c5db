"""Continuous batching: the engine's decode pool, where requests join and leave a running
batch between decode steps.

The pool holds every row being decoded in one KV cache (transformers' `DynamicCache`),
left-padded to the batch's width, the rows of one adapter contiguous (the multi-LoRA
router slices by row). Each row carries its last sampled token, not yet fed: a decode
step feeds that column for every row and draws each row's next token.

* Joining. Requests wait in arrival order; at the start of each slice those that fit are
  prefilled in one forward, ONE row per request whatever its `num_samples` (a GRPO
  group computes its prompt once), their first tokens drawn from that row's logits; its
  KV is then copied per sample and merged into the batch (both padded to the wider).
* Leaving. A row leaves the step it stops (a stop token, a stop string, `max_tokens`);
  a request is answered when its last row has left. Padding columns no row uses any
  more are dropped.
* Memory. The pool holds at most `capacity` KV positions. A row of a batch of width W
  with r tokens left to draw occupies at most W + r positions until it leaves (the
  width grows one column per step while r shrinks by one), so `admit` lets a request in
  only while the sum over rows stays within `capacity`; the rest wait, in order. A
  request that could not fit in an empty pool is refused at once, naming the limit.
* Steps in place. The cache's keys and values are the leading columns of buffers with
  spare columns (`_SpareColumnsLayer`): a step writes its column into them, where
  `DynamicLayer` would copy the whole cache; when none are left the cache moves into a
  buffer with as many spare columns as its rows have tokens left on average (at most
  `SPARE_COLUMNS`), so the buffers stay within the rows' footprint (plus a column a
  row).
* Prefix reuse. A request may name a cache namespace (its sampling session) and the
  version of its weights: the KV of its prompt, and with `num_samples` 1 of its prompt
  and completion, is kept, and a later prompt of the same namespace and version that
  extends one reuses it and computes only its new tokens (multi-turn RL). Entries live
  in the pool's capacity and are the first thing evicted when a request needs room.
* Several ranks. Each rank runs its own pool over its share of the requests; every
  forward gathers the sharded base's layers with the other ranks, so each prefill and
  step is agreed (`Parallel.any_rank`) and a rank with nothing to do runs an idle
  one-token forward. Rank 0's clock ends the slice for all.

Every row draws from its request's own `torch.Generator`, by the same calls in the same
order as the static batch (`sampler.generate`): a seeded request gives the same tokens
alone or beside others, by either path, unless a draw lands within rounding of a token
boundary.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from twinkle_server.engine.errors import EngineError, ResourceExhausted
from twinkle_server.engine.parallel import Parallel
from twinkle_server.engine.sampler import (
    GenerationRequest,
    Route,
    cache_keyword,
    idle_step,
    new_generator,
    pick,
    topk_arrays,
)
from twinkle_server.engine.types import Generation, SampledSequence

PREFIX_ENTRIES_PER_NAMESPACE = 8
"""Prompts kept per sampling session for prefix reuse (least recently used evicted)."""
SPARE_COLUMNS = 64
"""KV columns a step may write in place before the cache is copied into a wider buffer."""


@dataclass(frozen=True)
class Waiting:
    """What admission needs to know of a waiting request."""

    rows: int
    cached: int     # prompt tokens its prefix entry already holds
    suffix: int     # prompt tokens it must compute
    max_tokens: int


def footprint(width: int, remaining: Sequence[int]) -> int:
    """Most KV positions rows of a batch of `width`, with `remaining[i]` tokens still to
    draw, can occupy before they leave."""
    return sum(width + r for r in remaining)


def admit(width: int, remaining: Sequence[int], waiting: Sequence[Waiting], capacity: int,
          prefill_tokens: int) -> int:
    """How many of `waiting`, in order, join a batch of `width` whose rows have
    `remaining` tokens to draw, within `capacity` KV positions.

    Joiners are prefilled together, padded to their widest cached prefix plus their
    widest suffix, and the batch takes the wider width. At most `prefill_tokens` prompt
    tokens are computed per slice, but the first joiner always may (a prompt longer than
    the budget still runs). Stops at the first request that does not fit: it is next.
    """
    count, cached, suffix, computed = 0, 0, 0, 0
    rows: list[int] = list(remaining)
    for request in waiting:
        new_cached, new_suffix = max(cached, request.cached), max(suffix, request.suffix)
        new_width = max(width, new_cached + new_suffix)
        new_rows = rows + [request.max_tokens] * request.rows
        if footprint(new_width, new_rows) > capacity:
            break
        if count and computed + request.suffix > prefill_tokens:
            break
        count, cached, suffix, rows = count + 1, new_cached, new_suffix, new_rows
        computed += request.suffix
    return count


def never_fits(request: GenerationRequest, capacity: int) -> ResourceExhausted | None:
    """The refusal of a request too large for an empty pool, else None."""
    need = request.num_samples * (request.prompt.size + request.params.max_tokens)
    if need <= capacity:
        return None
    return ResourceExhausted(
        f"num_samples x (prompt + max_tokens): {request.num_samples} x "
        f"({request.prompt.size} + {request.params.max_tokens}) = {need} KV positions, over "
        f"the sampler's pool of {capacity} (--kv-pool-tokens); ask fewer samples or tokens "
        "per request")


@dataclass(eq=False)
class _Prefix:
    """A cached prompt's KV: `tokens` and per layer keys and values `[1, H, len, D]`."""

    tokens: np.ndarray
    layers: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class _Request:
    key: Any
    generation: GenerationRequest   # `adapter_id` is the route id
    namespace: tuple[str, str] | None
    generator: torch.Generator
    stops: set[int]
    prefix: _Prefix | None = None
    cached: int = 0
    rows: list[_Row] = field(default_factory=list)
    left: int = 0                   # rows still decoding


@dataclass(eq=False)
class _Row:
    request: _Request
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    reason: str | None = None


@dataclass
class PoolStats:
    """Counters since the pool was made, and its state now."""

    active_rows: int = 0
    waiting_requests: int = 0
    kv_capacity: int = 0
    kv_in_use: int = 0
    prefix_cache_tokens: int = 0
    prompt_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    tokens_decoded: int = 0
    decode_steps: int = 0


class DecodePool:
    """Rows being decoded, requests waiting to join, and the prefix cache of one rank.

    Args:
        model: the causal LM; every forward runs inside `route(row_adapter_ids)`.
        route: the multi-LoRA router.
        eos_token_ids: stop tokens of requests without `ignore_eos`.
        pad_token_id: the id of padding positions (never attended to).
        decode: token ids -> text, for stop strings.
        capacity: KV positions the pool may hold (`--kv-pool-tokens`).
        prefill_tokens: prompt tokens one slice computes, at most (its first joiner aside).
        parallel: this process's ranks; forwards are agreed across them.
    """

    def __init__(self, model: torch.nn.Module, route: Route, *, eos_token_ids: Sequence[int],
                 pad_token_id: int, decode: Callable[[Sequence[int]], str], capacity: int,
                 prefill_tokens: int, parallel: Parallel,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self.route, self.decode = model, route, decode
        self.eos = set(eos_token_ids)
        self.pad = pad_token_id
        self.capacity, self.prefill_tokens = capacity, prefill_tokens
        self.parallel, self.clock = parallel, clock
        self.device = next(model.parameters()).device
        self.cache_kw = cache_keyword(model)
        self.waiting: deque[_Request] = deque()
        self.rows: list[_Row] = []
        self.kv: Any = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.pending = torch.zeros(0, dtype=torch.long, device=self.device)
        self.prefixes: OrderedDict[tuple[str, str], OrderedDict[bytes, _Prefix]] = OrderedDict()
        self.finished: list[tuple[Any, Generation | EngineError]] = []
        self.counters = PoolStats(kv_capacity=capacity)

    # ------------------------------------------------------------------ requests

    def submit(self, key: Any, generation: GenerationRequest,
               namespace: tuple[str, str] | None = None) -> None:
        """Queue a checked request; its result comes out of a later `run` under `key`.
        `namespace` (session, weights version) enables prefix reuse; None keeps none."""
        refusal = never_fits(generation, self.capacity)
        if refusal is not None:
            self.finished.append((key, refusal))
            return
        params = generation.params
        self.waiting.append(_Request(
            key, generation, namespace, new_generator(params.seed, self.device),
            set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos)))

    def routes(self) -> set[str]:
        """The adapter ids rows and waiting requests route to (not to be unloaded)."""
        requests = list(self.waiting) + [row.request for row in self.rows]
        return {r.generation.adapter_id for r in requests if r.generation.adapter_id}

    def fail(self, adapter_id: str, error: EngineError) -> None:
        """End every row and waiting request routed to `adapter_id` with `error`."""
        for request in [r for r in self.waiting if r.generation.adapter_id == adapter_id]:
            self.waiting.remove(request)
            self.finished.append((request.key, error))
        doomed = {i for i, row in enumerate(self.rows)
                  if row.request.generation.adapter_id == adapter_id}
        failed = {id(self.rows[i].request): self.rows[i].request for i in doomed}
        self._keep([i for i in range(len(self.rows)) if i not in doomed])
        self.finished += [(request.key, error) for request in failed.values()]

    def reset(self, error: EngineError) -> None:
        """Fail every row and waiting request with `error` and empty the pool (after a
        forward failed: its cache can no longer be trusted)."""
        requests = {id(r.request): r.request for r in self.rows}
        requests.update({id(r): r for r in self.waiting})
        self.finished += [(r.key, error) for r in requests.values()]
        self.waiting.clear()
        self.prefixes.clear()
        self._keep([])

    def stats(self) -> PoolStats:
        c = self.counters
        c.active_rows, c.waiting_requests = len(self.rows), len(self.waiting)
        c.kv_in_use = self.mask.numel() + self._prefix_tokens()
        c.prefix_cache_tokens = self._prefix_tokens()
        return PoolStats(**vars(c))

    # ------------------------------------------------------------------ slices

    @torch.inference_mode()
    def run(self, slice_s: float) -> list[tuple[Any, Generation | EngineError]]:
        """Admit what fits, prefill it, then decode until no rank has rows or rank 0's
        `slice_s` seconds are up (one step at least); returns the requests finished."""
        parallel = self.parallel
        joiners = self._admit()
        if parallel.any_rank(bool(joiners)):
            if joiners:
                self._prefill(joiners)
            else:
                idle_step(self.model, self.route, self.pad, self.device)
        deadline = self.clock() + slice_s
        while parallel.any_rank(bool(self.rows)):
            if self.rows:
                self._step()
            else:
                idle_step(self.model, self.route, self.pad, self.device)
            if parallel.any_rank(parallel.rank == 0 and self.clock() >= deadline):
                break
        done, self.finished = self.finished, []
        return done

    def _admit(self) -> list[_Request]:
        for request in self.waiting:
            if request.prefix is None and request.namespace is not None:
                request.prefix = self._lookup(request)
        remaining = [row.request.generation.params.max_tokens - len(row.tokens)
                     for row in self.rows]
        def plan() -> int:
            capacity = self.capacity - self._prefix_tokens()
            return admit(self.mask.shape[1], remaining, [
                Waiting(r.generation.num_samples, r.cached,
                        r.generation.prompt.size - r.cached, r.generation.params.max_tokens)
                for r in self.waiting], capacity, self.prefill_tokens)
        count = plan()
        while not count and self.waiting and self._evict_prefix():
            count = plan()
        return [self.waiting.popleft() for _ in range(count)]

    # ------------------------------------------------------------------ prefix cache

    def _prefix_tokens(self) -> int:
        return sum(p.tokens.size for entries in self.prefixes.values()
                   for p in entries.values())

    def _lookup(self, request: _Request) -> _Prefix | None:
        """The namespace's entry sharing the longest prefix with the prompt, reused up to
        its last token (whose logits the prefill must compute)."""
        entries = self.prefixes.get(request.namespace)  # type: ignore[arg-type]
        prompt = np.asarray(request.generation.prompt)
        best, best_len = None, 0
        for key, entry in (entries or {}).items():
            n = min(entry.tokens.size, prompt.size - 1)
            same = np.flatnonzero(entry.tokens[:n] != prompt[:n])
            common = int(same[0]) if same.size else n
            if common > best_len:
                best, best_len = key, common
        if best is None:
            return None
        entries.move_to_end(best)  # type: ignore[union-attr]
        self.prefixes.move_to_end(request.namespace)  # type: ignore[arg-type]
        request.cached = best_len
        return entries[best]  # type: ignore[index]

    def _remember(self, namespace: tuple[str, str], tokens: np.ndarray,
                  layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        entries = self.prefixes.setdefault(namespace, OrderedDict())
        self.prefixes.move_to_end(namespace)
        entries[tokens.tobytes()] = _Prefix(tokens, layers)
        entries.move_to_end(tokens.tobytes())
        while len(entries) > PREFIX_ENTRIES_PER_NAMESPACE:
            entries.popitem(last=False)

    def _evict_prefix(self) -> bool:
        """Drop the least recently used prefix entry; False when there is none."""
        while self.prefixes:
            namespace, entries = next(iter(self.prefixes.items()))
            if entries:
                entries.popitem(last=False)
                return True
            del self.prefixes[namespace]
        return False

    # ------------------------------------------------------------------ compute

    def _prefill(self, joiners: list[_Request]) -> None:
        """One forward over each joiner's uncached prompt tokens, then its rows join."""
        order = _grouped([r.generation.adapter_id for r in joiners])
        joiners = [joiners[i] for i in order]
        cached = max(r.cached for r in joiners)
        suffix = max(r.generation.prompt.size - r.cached for r in joiners)
        n = len(joiners)
        ids = torch.full((n, suffix), self.pad, dtype=torch.long)
        positions = torch.zeros((n, suffix), dtype=torch.long)
        mask = torch.zeros((n, cached + suffix), dtype=torch.long)
        for i, request in enumerate(joiners):
            prompt = torch.from_numpy(np.asarray(request.generation.prompt, dtype=np.int64))
            own = prompt[request.cached:]
            ids[i, suffix - own.numel():] = own
            positions[i, suffix - own.numel():] = torch.arange(request.cached, prompt.numel())
            mask[i, cached - request.cached:cached] = 1
            mask[i, cached + suffix - own.numel():] = 1
        kv = _new_cache(self.model.config, _prefix_batch(joiners, cached) if cached else [])
        ids, positions, mask = (t.to(self.device) for t in (ids, positions, mask))
        with self.route([r.generation.adapter_id for r in joiners]):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1, **{self.cache_kw: kv})
        kv = getattr(out, self.cache_kw)
        counters = self.counters
        counters.prompt_tokens_computed += sum(r.generation.prompt.size - r.cached
                                               for r in joiners)
        counters.prefix_hit_tokens += sum(r.cached for r in joiners)
        for i, request in enumerate(joiners):
            if request.namespace is not None:
                self._remember(request.namespace, np.asarray(request.generation.prompt),
                               _row_kv(kv, i, mask[i]))
        rows_per = torch.tensor([r.generation.num_samples for r in joiners], device=self.device)
        index = torch.repeat_interleave(torch.arange(n, device=self.device), rows_per)
        _select(kv, index)
        new_rows = [_Row(r) for r in joiners for _ in range(r.generation.num_samples)]
        for request in joiners:
            request.rows = [row for row in new_rows if row.request is request]
            request.left = len(request.rows)
        lengths = torch.tensor([r.generation.prompt.size for r in joiners], device=self.device)
        self._join(kv, mask[index], lengths[index], new_rows)
        # Joining regroups the rows by adapter: draw for each new row where it now sits.
        where = {id(row): i for i, row in enumerate(self.rows)}
        order = sorted(range(len(new_rows)), key=lambda i: where[id(new_rows[i])])
        logits = out.logits[:, -1].float()[index]
        self._draw(logits[torch.tensor(order, device=self.device)],
                   [where[id(new_rows[i])] for i in order])
        self._leave()

    def _join(self, kv: Any, mask: torch.Tensor, positions: torch.Tensor,
              rows: list[_Row]) -> None:
        """Merge new rows (their cache, mask, next positions) into the batch, padded to
        the wider of the two, and regroup the rows by adapter."""
        pending = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        if not self.rows:
            self.kv, self.mask, self.positions, self.pending = kv, mask, positions, pending
            self.rows = list(rows)
        else:
            width = max(self.mask.shape[1], mask.shape[1])
            for old, new in zip(_layers_of(self.kv), _layers_of(kv), strict=True):
                old.keys = torch.cat([_left_pad(old.keys, width), _left_pad(new.keys, width)])
                old.values = torch.cat([_left_pad(old.values, width),
                                        _left_pad(new.values, width)])
            self.mask = torch.cat([_left_pad(self.mask, width), _left_pad(mask, width)])
            self.positions = torch.cat([self.positions, positions])
            self.pending = torch.cat([self.pending, pending])
            self.rows = self.rows + list(rows)
        order = _grouped([row.request.generation.adapter_id for row in self.rows])
        if order != list(range(len(self.rows))):
            self._reorder(order)

    def _reorder(self, order: list[int]) -> None:
        index = torch.tensor(order, dtype=torch.long, device=self.device)
        _select(self.kv, index)
        self.mask, self.positions = self.mask[index], self.positions[index]
        self.pending = self.pending[index]
        self.rows = [self.rows[i] for i in order]

    def _step(self) -> None:
        """Feed every row's pending token; draw each row's next."""
        self._reserve()
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=-1)
        with self.route([row.request.generation.adapter_id for row in self.rows]):
            out = self.model(input_ids=self.pending[:, None], attention_mask=self.mask,
                             position_ids=self.positions[:, None], use_cache=True,
                             logits_to_keep=1, **{self.cache_kw: self.kv})
        self.kv = getattr(out, self.cache_kw)
        self.positions = self.positions + 1
        self.counters.decode_steps += 1
        self._draw(out.logits[:, -1].float(), list(range(len(self.rows))))
        self._leave()

    def _reserve(self) -> None:
        """Give the cache spare columns when it has none left, so that steps write their
        column in place (`_SpareColumnsLayer`) instead of copying the whole cache each.

        It gets as many as the rows have tokens left on average (at most
        `SPARE_COLUMNS`): rows x spare stays within the rows' `footprint`, plus one
        column a row, so the pool's bound still holds."""
        if all(_spare(layer.keys) and _spare(layer.values) for layer in _layers_of(self.kv)
               if isinstance(layer, _SpareColumnsLayer)):
            return
        left = sum(row.request.generation.params.max_tokens - len(row.tokens)
                   for row in self.rows)
        extra = min(SPARE_COLUMNS, -(-left // len(self.rows)))
        for layer in _layers_of(self.kv):
            if isinstance(layer, _SpareColumnsLayer):
                layer.keys, layer.values = _widened(layer.keys, extra), _widened(layer.values, extra)

    def _draw(self, logits: torch.Tensor, batch_rows: list[int]) -> None:
        """Pick the next token of `batch_rows` (ascending batch positions, a request's
        contiguous; one segment per request, as the static batch does) from their
        `logits`, in the same order; mark the rows that stop."""
        rows = [self.rows[i] for i in batch_rows]
        chosen = torch.empty(len(rows), dtype=torch.long, device=self.device)
        start = 0
        while start < len(rows):
            request, end = rows[start].request, start
            while end < len(rows) and rows[end].request is request:
                end += 1
            chosen[start:end] = pick(logits[start:end], request.generation.params,
                                     request.generator)
            start = end
        logp = torch.log_softmax(logits, dim=-1)
        chosen_logp = logp.gather(-1, chosen[:, None]).squeeze(-1).tolist()
        widest = max(row.request.generation.topk_logprobs for row in rows)
        if widest:
            top = torch.topk(logp, min(widest, logp.shape[-1]), dim=-1)
            top_ids, top_lps = top.indices.cpu().numpy(), top.values.cpu().numpy()
        self.pending[torch.tensor(batch_rows, device=self.device)] = chosen
        self.counters.tokens_decoded += len(rows)
        for i, (row, token) in enumerate(zip(rows, chosen.tolist(), strict=True)):
            params = row.request.generation.params
            row.tokens.append(token)
            row.logprobs.append(chosen_logp[i])
            if k := row.request.generation.topk_logprobs:
                row.topk.append((top_ids[i, :k], top_lps[i, :k]))
            if token in row.request.stops or (params.stop_strings and any(
                    s in self.decode(row.tokens) for s in params.stop_strings)):
                row.reason = "stop"
            elif len(row.tokens) >= params.max_tokens:
                row.reason = "length"

    def _leave(self) -> None:
        """Answer requests whose last row stopped, keep the rest, drop dead padding."""
        keep = []
        for i, row in enumerate(self.rows):
            if row.reason is None:
                keep.append(i)
                continue
            request = row.request
            request.left -= 1
            if request.namespace is not None and request.generation.num_samples == 1:
                # Prompt + completion but its last token, which was never fed.
                tokens = np.concatenate([np.asarray(request.generation.prompt, np.int64),
                                         np.asarray(row.tokens[:-1], np.int64)])
                self._remember(request.namespace, tokens, _row_kv(self.kv, i, self.mask[i]))
            if request.left == 0:
                self.finished.append((request.key, _generation(request)))
        if len(keep) < len(self.rows):
            self._keep(keep)

    def _keep(self, keep: list[int]) -> None:
        if not keep:
            self.rows, self.kv = [], None
            self.mask = self.mask[:0, :0]
            self.positions, self.pending = self.positions[:0], self.pending[:0]
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        _select(self.kv, index)
        self.mask, self.positions = self.mask[index], self.positions[index]
        self.pending = self.pending[index]
        self.rows = [self.rows[i] for i in keep]
        used = torch.nonzero(self.mask.any(0))
        first = int(used[0]) if used.numel() else self.mask.shape[1]
        if first:
            for layer in _layers_of(self.kv):
                layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]
            self.mask = self.mask[:, first:]


def _generation(request: _Request) -> Generation:
    k = request.generation.topk_logprobs
    sequences = []
    for row in request.rows:
        ids, lps = topk_arrays(row.topk, k)
        sequences.append(SampledSequence(
            tokens=np.asarray(row.tokens, dtype=np.int32),
            logprobs=np.asarray(row.logprobs, dtype=np.float32),
            stop_reason=row.reason, topk_token_ids=ids, topk_logprobs=lps))  # type: ignore[arg-type]
    return Generation(sequences, prompt_cache_hit_tokens=request.cached)


def _grouped(adapter_ids: Sequence[str | None]) -> list[int]:
    """A stable order that puts the rows of each adapter together, by first appearance."""
    first: dict[str | None, int] = {}
    for i, adapter_id in enumerate(adapter_ids):
        first.setdefault(adapter_id, i)
    return sorted(range(len(adapter_ids)), key=lambda i: first[adapter_ids[i]])


# ---------------------------------------------------------------------- KV tensors

def _layers_of(cache: Any) -> list[Any]:
    """The cache's per-layer objects, each with `keys` and `values` `[B, H, W, D]`."""
    return list(cache.layers)


def _prefix_batch(joiners: list[_Request], width: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the joiners' cached prefixes as one batch `[n, H, width, D]`, each
    right-aligned (a joiner with none is all padding)."""
    shape = next(r.prefix for r in joiners if r.cached).layers  # type: ignore[union-attr]

    def part(request: _Request, layer: int, which: int, like: torch.Tensor) -> torch.Tensor:
        own = (request.prefix.layers[layer][which] if request.cached  # type: ignore[union-attr]
               else like)[..., :request.cached, :]
        return _left_pad(own, width)

    layers = []
    for layer, (keys, values) in enumerate(shape):
        layers.append((torch.cat([part(r, layer, 0, keys) for r in joiners]),
                       torch.cat([part(r, layer, 1, values) for r in joiners])))
    return layers


class _SpareColumnsLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values may be the leading columns of wider buffers
    (`DecodePool._reserve`): a step writes its new column into the spare ones in place,
    where `DynamicLayer` concatenates a copy of the whole cache each step."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        if (self.is_initialized and self.keys is not None and self.keys.numel()
                and _spare(self.keys) >= n and _spare(self.values) >= n):
            self.keys = _write_after(self.keys, key_states)
            self.values = _write_after(self.values, value_states)
            return self.keys, self.values
        return super().update(key_states, value_states, *args, **kwargs)


def _new_cache(config: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A cache for `config`'s layers (its full-attention layers `_SpareColumnsLayer`),
    holding `layers`' keys and values if any."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    cache.layers = [_SpareColumnsLayer() if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    for layer, (keys, values) in zip(cache.layers, layers, strict=False):
        layer.update(keys, values)
    return cache


def _spare(tensor: torch.Tensor) -> int:
    """Columns after `tensor` `[B, H, W, D]` within the buffer it is the leading columns
    of (`_widened`); 0 for any other tensor."""
    _, _, width, dim = tensor.shape
    batch_stride, head_stride, column_stride, unit = tensor.stride()
    if unit != 1 or column_stride != dim or head_stride < width * dim or head_stride % dim:
        return 0
    columns = head_stride // dim
    first = (tensor.storage_offset() // dim) % columns
    spare = columns - first - width
    last = (tensor.storage_offset() + (tensor.shape[0] - 1) * batch_stride
            + (tensor.shape[1] - 1) * head_stride + (width + spare) * dim)
    return spare if last * tensor.element_size() <= tensor.untyped_storage().nbytes() else 0


def _write_after(tensor: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`tensor` and then `new` along the columns, `new` written into `tensor`'s spare
    columns in place."""
    batch, heads, width, dim = tensor.shape
    out = tensor.as_strided((batch, heads, width + new.shape[-2], dim), tensor.stride(),
                            tensor.storage_offset())
    out[..., width:, :] = new
    return out


def _widened(tensor: torch.Tensor, extra: int) -> torch.Tensor:
    """A copy of `tensor` `[B, H, W, D]` as the leading columns of a new buffer with
    `extra` spare columns."""
    batch, heads, width, dim = tensor.shape
    buffer = tensor.new_empty((batch, heads, width + extra, dim))
    buffer[..., :width, :] = tensor
    return buffer[..., :width, :]


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """`tensor` with zero columns before its last-but-one (or, 2-D, last) axis up to
    `width`: KV `[B, H, W, D]` along W, masks `[B, W]` along W."""
    axis = tensor.dim() - 2 if tensor.dim() == 4 else tensor.dim() - 1
    missing = width - tensor.shape[axis]
    if missing <= 0:
        return tensor
    pad = [0, 0] * (tensor.dim() - 1 - axis) + [missing, 0]
    return F.pad(tensor, pad)


def _select(cache: Any, index: torch.Tensor) -> None:
    for layer in _layers_of(cache):
        layer.keys, layer.values = layer.keys[index], layer.values[index]


def _row_kv(cache: Any, row: int, mask_row: torch.Tensor
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row `row`'s KV at the positions its mask keeps, as `[1, H, n, D]` copies (a view
    would keep the whole batch's tensors alive)."""
    columns = torch.nonzero(mask_row).squeeze(-1)
    return [(layer.keys[row:row + 1, :, columns], layer.values[row:row + 1, :, columns])
            for layer in _layers_of(cache)]
