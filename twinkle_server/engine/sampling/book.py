"""The decode pool's books: its request records and their admission bookkeeping.

`PoolBook` holds what `DecodePool` (`sampling.pool`) knows of its requests: those
waiting and those with rows in the batch, the answers not yet taken, the counters, and
which waiting requests fit next (`admission`, keeping room for the prefix cache and the
shared prompt copies). The loop that prefills and steps the batch is `DecodePool`'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from twinkle_server.engine.errors import Cancelled, EngineError
from twinkle_server.engine.memory import OUT_OF_MEMORY
from twinkle_server.engine.sampling import tokens as token_step
from twinkle_server.engine.sampling.admission import (
    PLAIN,
    RowCost,
    Waiting,
    admit,
    copies,
    footprint,
    never_fits,
)
from twinkle_server.engine.sampling.kv_batch import KVBatch, compaction
from twinkle_server.engine.sampling.prefix_cache import Namespace, Prefix, PrefixCache
from twinkle_server.engine.types import Generation, Progress, SampleRequest


@dataclass(eq=False)
class PoolRequest:
    key: Any
    sample: SampleRequest
    route: str | None
    namespace: Namespace | None
    generator: torch.Generator
    stops: set[int]
    arrival: int
    prefix: Prefix | None = None
    cached: int = 0
    rows: list[PoolRow] = field(default_factory=list)
    left: int = 0                   # rows still decoding
    slices: int = 0                 # decode slices it has decoded in
    error: EngineError | None = None
    answered: bool = False


@dataclass(eq=False)
class PoolRow:
    request: PoolRequest
    sample: int = 0                 # which of the request's samples: the order it draws in
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    stop: token_step.Stop | None = None


@dataclass(frozen=True)
class PoolStats:
    """Counters since the pool was made, and its state when last published."""

    active_rows: int = 0
    waiting_requests: int = 0
    kv_capacity: int = 0
    kv_in_use: int = 0
    prefix_cache_tokens: int = 0
    prompt_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    tokens_decoded: int = 0
    decode_steps: int = 0


class PoolBook:
    """The requests of one rank's decode pool, waiting and decoding, and their answers.

    Args:
        capacity: KV positions the pool may hold (`--kv-pool-tokens`).
        prefill_tokens: prompt tokens one slice computes, at most (its first joiner aside).
        device: where the KV batch lives and the requests' generators draw.
        eos: stop tokens of requests without `ignore_eos`.
        batch_invariant: no shared prompt copies to keep room for (`engine.batch_invariant`).
        cost: KV positions a row takes, by its length (`admission.RowCost`).
    """

    def __init__(self, capacity: int, prefill_tokens: int, device: torch.device,
                 eos: Sequence[int], batch_invariant: bool, cost: RowCost = PLAIN) -> None:
        self.capacity, self.prefill_tokens = capacity, prefill_tokens
        self.device, self.eos, self.batch_invariant = device, tuple(eos), batch_invariant
        self.cost = cost
        self.waiting: deque[PoolRequest] = deque()
        self.rows: list[PoolRow] = []
        self.batch = KVBatch(self.device, cost.state)
        self.prefixes = PrefixCache(cost=cost)
        self.finished: list[tuple[Any, Generation | EngineError]] = []
        self.counters = PoolStats(kv_capacity=capacity)
        self._arrivals = 0
        self._published = self.counters

    def submit(self, key: Any, request: SampleRequest, route: str | None,
               namespace: Namespace | None = None) -> None:
        """Queue a checked request routed to `route`; its result comes out of a later
        `run` under `key`. `namespace` (session, weights version) enables prefix reuse."""
        refusal = never_fits(request, self.capacity, self.cost)
        if refusal is not None:
            self.answer(key, refusal)
            return
        self._arrivals += 1
        self.waiting.append(PoolRequest(
            key, request, route, namespace,
            token_step.new_generator(request.params.seed, self.device),
            token_step.stop_tokens(request.params, self.eos), self._arrivals))
        self._publish()

    def answer(self, key: Any, error: EngineError) -> None:
        """Answer `key` with `error` at the next `run` (a request refused before it came
        in)."""
        self.finished.append((key, error))

    def routes(self) -> set[str]:
        """The route ids rows and waiting requests use (not to be unloaded)."""
        return {r.route for r in self._requests() if r.route is not None}

    def cancel(self, keys: Iterable[Any]) -> None:
        """End the requests under `keys` (waiting or decoding) with `Cancelled`; their rows
        leave now. Keys the pool no longer has are ignored."""
        keys = set(keys)
        self._fail([r for r in self._requests() if r.key in keys],
                   Cancelled("sampling: the request was cancelled"))

    def fail(self, route: str, error: EngineError) -> None:
        """End every request routed to `route` with `error`."""
        self._fail([r for r in self._requests() if r.route == route], error)

    def reset(self, error: EngineError) -> None:
        """Fail every request with `error` and empty the pool (a fault no request could be
        held to: its state is unknown)."""
        for request in self._requests():
            self._answer(request, error)
        self.waiting.clear()
        self.rows = []
        self.batch.clear()
        self.prefixes.clear()
        self._publish()

    def take_finished(self) -> list[tuple[Any, Generation | EngineError]]:
        done, self.finished = self.finished, []
        return done

    def progress(self) -> list[tuple[Any, Progress]]:
        """Each streamed request still decoding, with its rows drawn so far."""
        return [(request.key, Progress(
                    [token_step.sequence(r.tokens, r.logprobs, r.topk,
                                         request.sample.topk_logprobs, r.stop)
                     for r in request.rows]))
                for request in self._decoding() if request.sample.stream]

    def stats(self) -> PoolStats:
        """The counters and state as the worker last published them (any thread)."""
        return self._published

    def _requests(self) -> list[PoolRequest]:
        return list(self.waiting) + self._decoding()

    def _decoding(self) -> list[PoolRequest]:
        """The requests with rows in the batch, in the order of their first rows."""
        return list(dict.fromkeys(row.request for row in self.rows))

    def _fail(self, requests: list[PoolRequest], error: EngineError) -> None:
        for request in requests:
            if request in self.waiting:
                self.waiting.remove(request)
                self._answer(request, error)
            elif request.error is None:
                request.error = error
        self._leave()
        self._publish()

    def _answer(self, request: PoolRequest, result: Generation | EngineError) -> None:
        if not request.answered:
            request.answered = True
            self.finished.append((request.key, result))

    def _publish(self) -> None:
        self._published = replace(
            self.counters, active_rows=len(self.rows), waiting_requests=len(self.waiting),
            kv_in_use=self.batch.held() + self.prefixes.tokens,
            prefix_cache_tokens=self.prefixes.tokens)

    def _count(self, **more: int) -> None:
        self.counters = replace(self.counters, **{k: getattr(self.counters, k) + v
                                                 for k, v in more.items()})

    # ------------------------------------------------------------------ admission

    def _admit(self) -> list[PoolRequest]:
        """The waiting requests that join now, each with the cached prefix it reuses.
        Those left waiting hold none (they look again next time): the cache may give up
        an entry, whose memory must then go."""
        for request in self.waiting:
            if request.namespace is not None:
                request.prefix, request.cached = self.prefixes.lookup(
                    request.namespace, np.asarray(request.sample.prompt))
        remaining = self._remaining()

        def plan(room: int) -> int:
            return admit(self.batch.width, remaining, [
                Waiting(r.sample.num_samples, r.cached, r.sample.prompt.size - r.cached,
                        r.sample.params.max_tokens) for r in self.waiting],
                room, self.prefill_tokens, self._samples(), self._copied_width(), self.cost)
        count = plan(self.capacity - self.prefixes.tokens)
        # Cached prefixes, least recently used first, make way for as many waiting
        # requests as could join without any: only where that lets more of them join.
        # An entry a joiner reuses is copied into its row by its prefill, so giving it
        # up frees nothing until then; where only such entries are left, the next
        # request and those after it give up their own (and compute those tokens): its
        # own entry beside its row may pass the capacity, and it would wait forever.
        most = plan(self.capacity) if self.prefixes.tokens else count
        given_up = False
        while count < most:
            waiting = list(self.waiting)
            reused = {r.prefix for r in waiting[:most] if r.prefix is not None}
            if self.prefixes.evict_one(keep=reused):
                count = plan(self.capacity - self.prefixes.tokens)
            elif given_up:
                break
            else:
                given_up = True
                for request in waiting[count:]:
                    request.prefix, request.cached = None, 0
                most = plan(self.capacity)
        joiners = [self.waiting.popleft() for _ in range(count)]
        for request in self.waiting:
            request.prefix, request.cached = None, 0
        return joiners

    def _remaining(self) -> list[int]:
        return [row.request.sample.params.max_tokens - len(row.tokens) for row in self.rows]

    def _samples(self) -> list[int]:
        """`num_samples` of each request decoding, in row order."""
        return [request.sample.num_samples for request in self._decoding()]

    def _copied_width(self) -> int:
        """Columns of each request's rows a shared copy would hold (`KVBatch.shared_prefix`),
        for which admission and the prefix cache keep room; none in the batch-invariant
        mode, whose steps read every row's own cache and make no copy."""
        return 0 if self.batch_invariant else self.batch.shared_width()

    def _held_by_rows(self) -> int:
        """Most KV positions the rows hold from now until they leave, their shared copy
        aside: their footprint (`admission.footprint`), or what their buffers hold
        already where that is more (`KVBatch.buffered`: columns and rows of rows that
        left, held until the buffers are replaced; then a row holds at most its
        footprint's share and one column)."""
        return max(footprint(self.batch.width, self._remaining(), self.cost),
                   self.batch.buffered())

    def _fit_prefixes(self) -> None:
        """Give up cached prefixes the rows and their shared copies leave no room for."""
        self.prefixes.fit(self.capacity - self._held_by_rows()
                          - copies(self._samples(), self._copied_width()))

    def _leave(self) -> None:
        """Answer requests whose last row stopped or that failed; keep the other rows.
        What allocates (copying a finished row's prefix entry, moving the rows that
        stay) runs before anything changes, so a failure changes nothing; an entry the
        memory cannot hold is not kept."""
        entries = []
        for i, row in enumerate(self.rows):
            request = row.request
            if (request.error is None and row.stop is not None
                    and request.namespace is not None and request.sample.num_samples == 1):
                # Prompt + completion but its last token, which was never fed.
                tokens = np.concatenate([np.asarray(request.sample.prompt, np.int64),
                                         np.asarray(row.tokens[:-1], np.int64)])
                try:
                    entries.append((request.namespace, tokens, *self.batch.row_prefix(i)))
                except OUT_OF_MEMORY:
                    pass
        keep = [i for i, row in enumerate(self.rows)
                if row.request.error is None and row.stop is None]
        order = None
        if len(keep) < len(self.rows):
            order = compaction([row.request.route for row in self.rows], keep)
            self.batch.select(order)
        for row in self.rows:
            request = row.request
            if request.error is not None:
                self._answer(request, request.error)
            elif row.stop is not None:
                request.left -= 1
                if request.left == 0:
                    self._finish(request)
        for namespace, tokens, layers, states in entries:
            self.prefixes.remember(namespace, tokens, layers, states)
        if order is not None:
            self.rows = [self.rows[i] for i in order]
        self._fit_prefixes()

    def _finish(self, request: PoolRequest) -> None:
        """Answer `request`, every row of which has stopped, with its sequences."""
        self._answer(request, Generation(
            [token_step.sequence(r.tokens, r.logprobs, r.topk, request.sample.topk_logprobs,
                                 r.stop) for r in request.rows],
            prompt_cache_hit_tokens=request.cached, decode_slices=request.slices))
