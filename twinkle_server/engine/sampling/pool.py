"""Continuous batching: the decode pool, where sample requests join and leave a running
batch between decode steps.

* Layer kinds. Full attention's keys and values, a sliding window's last columns, and a
  hybrid's linear-attention and Mamba states per row (`cache_layers`), each counted by
  admission at what it holds (`row_cost`); other local attention is refused.
* Joining. Requests wait in arrival order; at the start of each slice those that fit
  (`admission`) are prefilled in one forward (on a model that reuses prefixes whole, one
  forward for each number of new tokens among the joiners with a cached prefix:
  `_prefill_groups`), ONE row per request whatever its `num_samples` (a GRPO group
  computes its prompt once), their first tokens drawn from that row's logits; its KV is
  then copied per sample and joins the batch (`kv_batch`).
* Leaving. A row leaves the step it stops (a stop token, a stop string, `max_tokens`),
  one that stops at its first token never joins; a request is answered when its last
  row has left. Its place is taken by its route's
  last row, moved within the cache's buffers; no other row moves (`kv_batch.compaction`),
  so a request's samples may sit apart, and each step draws them in their own order.
* Memory. The batch's footprint (`admission.footprint`) plus the prefix cache stays
  within `capacity`: admission keeps to it, and the prefix cache gives up entries
  whenever what it stored would pass it. Both leave room for the copies of their
  prompts' columns a request's samples share (`KVBatch.shared_prefix`), which is made
  only where it fits. Rows that leave leave their columns in the buffers until these are
  replaced (`KVBatch.buffered`), which the prefix cache and the shared copy make room for
  too. Held positions (rows x buffer columns, the shared copy, the cache) are at most
  `capacity` plus one column a row.
* Prefix reuse. A request may name a namespace (its sampling session and the version of
  its weights): the KV of its prompt, and with `num_samples` 1 of its prompt and
  completion, is kept (`prefix_cache`), and a later prompt of the same namespace that
  extends one computes only its new tokens. A hybrid's entry keeps its recurrent layers'
  states after its last token, a sliding window's layers their last W - 1 positions:
  such an entry is reused whole, by a prompt that extends every one of its tokens (the
  next turn of a conversation), its prefill going on from it with no padding between
  (`_prefill_groups`), which the states would run through and a window would count.
* Faults stay with their request. Logits that are not finite fail that request alone
  (`tokens.not_finite`). A prefill that fails (out of memory, a device error) has changed
  nothing: with several joiners each is prefilled again alone (on one rank), so only the
  one that fails alone fails. A step that fails is undone (`KVBatch.restore`); out of memory
  fails the newest request, the one whose admission the memory could not hold, and any
  other error fails the requests of that step, whose state is unknown; the rest go on.
  Rows that leave are moved before anything changes, and fail as a step does (out of
  memory: the newest request still decoding); a finished row's prefix entry that memory
  cannot hold is not kept. A cancelled request leaves at once. On several ranks `fault` raises instead (a rank
  that skipped a forward would leave the others waiting in a collective).
* Several ranks. Each rank runs its own pool over its share of the requests; every
  forward gathers the sharded base's layers with the other ranks, so each prefill and
  step is agreed (`Parallel.any_rank`) and a rank with nothing to do runs an idle
  one-token forward. Rank 0's clock ends the slice for all.

Every row draws from its request's own `torch.Generator`, by the same calls in the same
order as the static batch: a seeded request gives the same tokens alone or beside
others, by either path (`tokens`). Only the worker thread calls the pool; `stats` reads a
snapshot the worker publishes, so any thread may read it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from twinkle_server.engine import memory
from twinkle_server.engine.errors import (
    EngineError,
    InvalidArgument,
    ResourceExhausted,
)
from twinkle_server.engine.parallel import Parallel
from twinkle_server.engine.sampling import tokens as token_step
from twinkle_server.engine.sampling.admission import RowCost
from twinkle_server.engine.sampling.book import PoolBook, PoolRequest, PoolRow
from twinkle_server.engine.sampling.cache_layers import (
    attention_windows,
    new_cache,
    state_layers,
    unsupported_layers,
    window_columns,
)
from twinkle_server.engine.sampling.decode_attention import decoding
from twinkle_server.engine.sampling.kv_batch import (
    prefix_batch,
    prefix_states,
    row_kv,
    row_states,
    select_rows,
)
from twinkle_server.engine.sampling.static import Route, cache_keyword, forwarding, idle_step
from twinkle_server.engine.types import Generation, Progress

SPARE_COLUMNS = 64
"""KV columns a step may write in place before the batch moves into wider buffers."""

Fault = Callable[[BaseException, str], EngineError]


def _strict(exc: BaseException, what: str) -> EngineError:
    """The default `fault`: an engine error stays with its request; anything else raises."""
    if isinstance(exc, EngineError):
        return exc
    raise exc


def row_cost(config: Any, dtype: torch.dtype) -> RowCost:
    """What a decoding row of a model of `config` in `dtype` takes, by its length: its
    sliding windows' layers hold their window's columns and the spare ones at most, and
    its recurrent states (a hybrid's linear-attention or Mamba layers) take the room of
    as many KV positions as their bytes, rounded up."""
    windows = attention_windows(config)
    sliding = [w for w in windows if w is not None]
    state = 0
    if state_layers(config):
        state = -(-memory.state_bytes_per_row(config)
                  // max(1, memory.kv_bytes_per_token(config, dtype)))
    return RowCost(state, len(sliding), max(1, len(windows)),
                   max(map(window_columns, sliding), default=0) + SPARE_COLUMNS)


def refusal(config: Any) -> InvalidArgument | None:
    """Why the pool cannot hold the cache of a model of `config`, or None."""
    if unsupported := unsupported_layers(config):
        return InvalidArgument(
            f"--sampler continuous: the model has cache layers the decode pool cannot "
            f"hold ({', '.join(unsupported)}: local attention other than a sliding "
            "window); serve it with --sampler static")
    return None


class DecodePool(PoolBook):
    """Rows being decoded, requests waiting to join, and the prefix cache of one rank.

    Args:
        model: the causal LM; every forward runs inside `route(row_route_ids)`.
        route: the multi-LoRA router.
        eos_token_ids: stop tokens of requests without `ignore_eos`.
        pad_token_id: the id of padding positions (never attended to).
        decode: token ids -> text, for stop strings.
        capacity: KV positions the pool may hold (`--kv-pool-tokens`).
        prefill_tokens: prompt tokens one slice computes, at most (its first joiner aside).
        parallel: this process's ranks; forwards are agreed across them.
        fault: a failed forward's exception and what ran -> the error its requests get
            (or raise, to fail the slice).
        batch_invariant: every forward batch-invariant (`engine.batch_invariant`): a
            row's numbers as alone, whatever the batch, the slice or the prefix cache.

    Raises:
        InvalidArgument: the model has cache layers the pool cannot hold.
    """

    def __init__(self, model: torch.nn.Module, route: Route, *, eos_token_ids: Sequence[int],
                 pad_token_id: int, decode: Callable[[Sequence[int]], str], capacity: int,
                 prefill_tokens: int, parallel: Parallel, fault: Fault = _strict,
                 clock: Callable[[], float] = time.monotonic,
                 batch_invariant: bool = False) -> None:
        if (refused := refusal(model.config)) is not None:
            raise refused
        weights = next(model.parameters())
        config = model.config
        super().__init__(capacity, prefill_tokens, weights.device, eos_token_ids,
                         batch_invariant, row_cost(config, weights.dtype))
        self.model, self.route, self.decode = model, route, decode
        self.pad = pad_token_id
        self.parallel, self.fault, self.clock = parallel, fault, clock
        self.cache_kw = cache_keyword(model)

    # ------------------------------------------------------------------ slices

    @torch.inference_mode()
    def run(self, slice_s: float) -> list[tuple[Any, Generation | EngineError | Progress]]:
        """Admit what fits, prefill it, then decode until no rank has rows or rank 0's
        `slice_s` seconds are up (one step at least); returns the requests finished, and
        the progress of streamed ones still decoding."""
        parallel = self.parallel
        groups = self._prefill_groups(self._admit())
        while parallel.any_rank(bool(groups)):
            if groups:
                self._prefill_apart(groups.pop(0))
            else:
                idle_step(self.model, self.route, self.pad, self.device)
        deadline = self.clock() + slice_s
        for request in self._decoding():
            request.slices += 1
        while parallel.any_rank(bool(self.rows)):
            if self.rows:
                self._step()
            else:
                idle_step(self.model, self.route, self.pad, self.device)
            if parallel.any_rank(parallel.rank == 0 and self.clock() >= deadline):
                break
        self._publish()
        return self.take_finished() + self.progress()

    # ------------------------------------------------------------------ compute

    def _prefill_groups(self, joiners: list[PoolRequest]) -> list[list[PoolRequest]]:
        """The joiners by the prefill each joins in: one for all, but on a model whose
        prefixes are reused whole (recurrent states, sliding windows) a joiner with a
        cached prefix must have no padding between that prefix and its new tokens
        (padding would run through the states, and a window would count it), so it
        joins with those whose new tokens are as many as its own, and those without a
        prefix join the longest."""
        if not joiners:
            return []
        if not self.prefixes.whole:
            return [joiners]
        longest = max(r.sample.prompt.size - r.cached for r in joiners)
        groups: dict[int, list[PoolRequest]] = {}
        for request in joiners:
            new = request.sample.prompt.size - request.cached
            groups.setdefault(new if request.cached else longest, []).append(request)
        return list(groups.values())

    def _prefill_apart(self, joiners: list[PoolRequest]) -> None:
        """Prefill `joiners` together; if that fails, on one rank each alone, so that only
        a joiner that fails by itself fails. On several ranks the failure is the slice's
        (`fault` raises): a forward one rank ran again alone would find no other rank in
        its collectives."""
        drawn_from = _generator_states(joiners)
        try:
            self._prefill(joiners)
        except Exception as exc:
            _restore(drawn_from)     # each is drawn again from where it stood
            if len(joiners) > 1 and self.parallel.world == 1:
                for joiner in joiners:
                    self._prefill_apart([joiner])
                return
            sizes = [str(joiner.sample.prompt.size) for joiner in joiners]
            what = (f"the prefill of a {sizes[0]}-token prompt" if len(joiners) == 1 else
                    f"the prefill of {len(joiners)} prompts of {', '.join(sizes)} tokens")
            error = self.fault(exc, what)
            for joiner in joiners:
                self._answer(joiner, error)

    def _prefill(self, joiners: list[PoolRequest]) -> None:
        """One forward over the joiners' uncached prompt tokens, then their rows join.
        Nothing changes before the forward and the draw have succeeded, and nothing that
        can fail follows the join (`_prefill_apart` would prefill the joiners again)."""
        joiners = [joiners[i] for i in _grouped([r.route for r in joiners])]
        cached = max(r.cached for r in joiners)
        suffix = max(r.sample.prompt.size - r.cached for r in joiners)
        n = len(joiners)
        ids = torch.full((n, suffix), self.pad, dtype=torch.long)
        positions = torch.zeros((n, suffix), dtype=torch.long)
        mask = torch.zeros((n, cached + suffix), dtype=torch.long)
        for i, request in enumerate(joiners):
            prompt = torch.from_numpy(np.asarray(request.sample.prompt, dtype=np.int64))
            own = prompt[request.cached:]
            ids[i, suffix - own.numel():] = own
            positions[i, suffix - own.numel():] = torch.arange(request.cached, prompt.numel())
            mask[i, cached - request.cached:cached] = 1
            mask[i, cached + suffix - own.numel():] = 1
        prefixes, lengths = [r.prefix for r in joiners], [r.cached for r in joiners]
        kv = new_cache(self.model.config, prefix_batch(
            [p.layers if p is not None else None for p in prefixes], lengths, cached)
            if cached else [], prefix_states(
            [p.states if p is not None else None for p in prefixes], lengths))
        ids, positions, mask = (t.to(self.device) for t in (ids, positions, mask))
        with self.route([r.route for r in joiners]), forwarding(self.model,
                                                                self.batch_invariant):
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             use_cache=True, logits_to_keep=1, **{self.cache_kw: kv})
        kv = getattr(out, self.cache_kw)
        index = torch.repeat_interleave(torch.arange(n, device=self.device), torch.tensor(
            [r.sample.num_samples for r in joiners], device=self.device))
        rows = [PoolRow(r, s) for r in joiners for s in range(r.sample.num_samples)]
        drawn = self._draw(out.logits[:, -1].float()[index], rows)
        self._take(drawn, rows)
        prompts = {id(r): (r.namespace, row_kv(kv, i, mask[i]), row_states(kv, i))
                   for i, r in enumerate(joiners) if r.namespace is not None and r.error is None}
        for request in joiners:
            request.rows = [row for row in rows if row.request is request]
            request.left = sum(row.stop is None for row in request.rows)
        # A row that stopped at its first token never joins (its prompt's entry is its
        # prefix entry): nothing that allocates follows the join.
        keep = [i for i, row in enumerate(rows)
                if row.request.error is None and row.stop is None]
        if keep:
            picked = torch.tensor(keep, device=self.device)
            select_rows(kv, index[picked])
            joined = self.rows + [rows[i] for i in keep]
            order = _grouped([r.request.route for r in joined])
            self.batch.join(kv, mask[index[picked]],
                            torch.tensor([rows[i].request.sample.prompt.size for i in keep],
                                         device=self.device),
                            drawn.chosen[picked], order, groups=index[picked].tolist())
            self.rows = [joined[i] for i in order]
        for request in joiners:     # after the join: a join that fails answers nobody
            request.prefix = None   # its rows hold what it reused; the entry may go
            if request.error is not None:
                self._answer(request, request.error)
            elif not request.left:
                self._finish(request)
        self._count(prompt_tokens_computed=sum(r.sample.prompt.size - r.cached
                                               for r in joiners),
                    prefix_hit_tokens=sum(r.cached for r in joiners))
        for request in joiners:
            if id(request) in prompts:
                namespace, layers, states = prompts[id(request)]
                self.prefixes.remember(namespace, np.asarray(request.sample.prompt), layers,
                                       states)
        self._fit_prefixes()

    def _step(self) -> None:
        """Feed every row's pending token and draw each row's next; a failed forward is
        undone and fails the requests it can be held to."""
        batch = self.batch
        remaining = self._remaining()
        room = self.capacity - self.prefixes.tokens - self._held_by_rows()
        saved = batch.snapshot()
        requests = self._decoding()
        drawn_from = _generator_states(requests)
        try:
            # New spare columns copy the whole cache: out of memory there is the step's.
            # As many as the rows' mean tokens left (1 at least), rounded down: the
            # buffers then hold no more than the rows' footprint, which they keep for
            # rows that leave until the next reserve.
            batch.reserve(min(SPARE_COLUMNS, sum(remaining) // len(self.rows)))
            with self.route([row.request.route for row in self.rows]), \
                    self._stepping(room):
                out = self.model(**batch.step_inputs(), use_cache=True, logits_to_keep=1,
                                 **{self.cache_kw: batch.cache})
            # The draw changes no row: failing, it is the step's, undone with it.
            drawn = self._draw(out.logits[:, -1].float(), self.rows)
        except Exception as exc:
            batch.restore(saved)
            _restore(drawn_from)     # a request that goes on draws as if alone
            error = self.fault(exc, f"a decode step of {len(self.rows)} rows")
            if isinstance(error, ResourceExhausted):
                requests = [max(requests, key=lambda r: r.arrival)]
            self._fail(list(requests), error)
            return
        self._count(decode_steps=1)
        self._take(drawn, self.rows)
        batch.advance(drawn.chosen)
        self._leave()

    def _leave(self) -> None:
        """`PoolBook._leave`, which changes nothing where it fails: out of memory there
        (moving the rows that stay) fails the newest request still decoding, as in a
        step, and the rows leave again, its own with them; any other fault fails every
        request decoding. Once every one has failed no row stays, and nothing moves."""
        while True:
            try:
                super()._leave()
                return
            except Exception as exc:
                going = [r for r in self._decoding()
                         if r.error is None and any(row.stop is None for row in r.rows)]
                if not going:
                    raise
                error = self.fault(exc, f"the leaving of rows from a batch of "
                                        f"{len(self.rows)}")
                if isinstance(error, ResourceExhausted):
                    going = [max(going, key=lambda r: r.arrival)]
                for request in going:
                    request.error = error

    def _stepping(self, room: int) -> AbstractContextManager:
        """The context of a decode step's forward: batch-invariant, or the decode path
        that reads a group's shared prompt once (`decode_attention`)."""
        if self.batch_invariant:
            return forwarding(self.model, True)
        return decoding(self.model, self.batch.shared_prefix(room))

    def _draw(self, logits: torch.Tensor, rows: list[PoolRow]) -> token_step.Drawn:
        """Draw the next token of `rows` from their `logits`, each request's rows in its
        samples' order wherever they sit (one segment a request, as the static batch
        draws them); changes no row (`_take` does)."""
        held: dict[PoolRequest, list[tuple[int, int]]] = {}
        for i, row in enumerate(rows):
            held.setdefault(row.request, []).append((row.sample, i))
        segments = [token_step.Segment([i for _, i in sorted(places)], request.sample.params,
                                       request.generator)
                    for request, places in held.items()]
        return token_step.draw(logits, segments,
                               max(row.request.sample.topk_logprobs for row in rows))

    def _take(self, drawn: token_step.Drawn, rows: list[PoolRow]) -> None:
        """Give `rows` their `drawn` tokens; mark the rows that stop, and fail the
        requests whose logits were not finite."""
        for i, row in enumerate(rows):
            request = row.request
            if not drawn.finite(i):
                request.error = request.error or token_step.not_finite(request.sample)
                continue
            row.tokens.append(drawn.tokens[i])
            row.logprobs.append(drawn.logprobs[i])
            if k := request.sample.topk_logprobs:
                row.topk.append((drawn.top_ids[i, :k], drawn.top_logprobs[i, :k]))  # type: ignore[index]
            row.stop = token_step.stop_reason(row.tokens, request.sample.params,
                                              request.stops, self.decode)
        self._count(tokens_decoded=sum(drawn.finite(i) for i in range(len(rows))))

def _generator_states(requests: Iterable[PoolRequest]) -> list[tuple[torch.Generator,
                                                                    torch.Tensor]]:
    """Each request's generator and where it stands, for `_restore`: a forward or draw
    that fails may have drawn from some, and those that go on must draw as if alone."""
    return [(r.generator, r.generator.get_state()) for r in requests]


def _restore(states: Sequence[tuple[torch.Generator, torch.Tensor]]) -> None:
    for generator, state in states:
        generator.set_state(state)


def _grouped(routes: Sequence[str | None]) -> list[int]:
    """A stable order that puts the rows of each route together, by first appearance."""
    first: dict[str | None, int] = {}
    for i, route in enumerate(routes):
        first.setdefault(route, i)
    return sorted(range(len(routes)), key=lambda i: first[routes[i]])

