"""Rank 0's ends of a split model's sampler ranks: their calls, their weights, whether
they are alive, and what each decodes now.

Each sampler rank has two gloo channels with rank 0 (`sampler_rank.Link`):

- calls: one at a time (`calls_lock`), each answered on the same channel. A decode slice
  goes to every busy sampler rank before any answer is read, and the answers are read on
  threads of their own, so a hung rank holds up its own answer only, and every other
  rank's channel is free again (for its keepalive) as soon as its answer is in.
- weights: messages queue in the rank's `outbox` and a sender thread of its own sends
  them in order, so publishing never waits for a slow or hung sampler rank; the publish
  gate on the sampler rank (`sampler_rank`) holds a request until its version arrives.

Idle channels get a no-op well within the collective timeout, so a sampler rank waiting
on either never times out. A channel that fails marks its rank lost: its requests end
UNAVAILABLE naming it (`take_failed`), and nothing is sent to it again.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, fields
from typing import Any

from twinkle_server.engine.errors import EngineError, Unavailable
from twinkle_server.engine.sampling.book import PoolStats
from twinkle_server.ranks.sampler_rank import NOOP, STOP, Link

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SamplerEnd:
    """Rank 0's end of one sampler rank: its link, the requests it decodes now (key ->
    (tokens, routing key)), its pool's last stats, and why it was lost."""

    link: Link
    calls_lock: threading.Lock = field(default_factory=threading.Lock)
    outbox: queue.Queue = field(default_factory=queue.Queue)
    outstanding: dict[int, tuple[int, str | None]] = field(default_factory=dict)
    stats: PoolStats = field(default_factory=PoolStats)
    last_call: float = field(default_factory=time.monotonic)
    lost: str | None = None

    @property
    def rank(self) -> int:
        return self.link.rank


class SamplerLinks:
    """Every sampler rank of one split model, as rank 0 sees them. `lock` guards
    `outstanding` and `lost` here, and the publication bookkeeping of the engine that
    owns these links (`split.SplitEngine`), so a request is routed and pinned at once."""

    def __init__(self, links: Sequence[Link], timeout_s: float) -> None:
        self.samplers = [SamplerEnd(link) for link in links]
        self.timeout_s = timeout_s
        self.interval_s = max(0.05, timeout_s / 4)
        self.lock = threading.Lock()
        self._failed: list[tuple[int, EngineError]] = []
        self._private = itertools.count(-1, -1)   # keys of calls outside decode slices
        self._closed = threading.Event()
        self._readers = ThreadPoolExecutor(max(1, len(self.samplers)),
                                           thread_name_prefix="twinkle-sampler-answer")
        self._threads = [threading.Thread(target=work, args=(sampler,), daemon=True,
                                          name=f"twinkle-{name}-{sampler.rank}")
                         for sampler in self.samplers
                         for work, name in ((self._keep_calls_alive, "keepalive"),
                                            (self._send_weights, "weights"))]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------------ routing

    def alive(self) -> list[SamplerEnd]:
        with self.lock:
            return [s for s in self.samplers if s.lost is None]

    def route(self, key: int | None, tokens: int, routing_key: str | None,
              still_held: Callable[[], bool]) -> tuple[int, SamplerEnd] | None:
        """Give a request (`key`, or a private one when None) to the sampler rank with the
        fewest tokens in flight, pinning its weights (`routing_key`), provided
        `still_held()` (checked under `lock`): False when they were released since.
        Raises UNAVAILABLE when no sampler rank is left."""
        with self.lock:
            if not still_held():
                return None
            alive = [s for s in self.samplers if s.lost is None]
            if not alive:
                raise Unavailable(self.none_left())
            sampler = min(alive, key=lambda s: (sum(t for t, _ in s.outstanding.values()),
                                                s.rank))
            key = next(self._private) if key is None else key
            sampler.outstanding[key] = (tokens, routing_key)
            return key, sampler

    def owner(self, key: int) -> SamplerEnd | None:
        with self.lock:
            return next((s for s in self.samplers
                         if s.lost is None and key in s.outstanding), None)

    def done(self, sampler: SamplerEnd, keys: Sequence[int]) -> None:
        with self.lock:
            for key in keys:
                sampler.outstanding.pop(key, None)

    def pinned(self) -> set[str]:
        """Routing keys of requests in flight (call with `lock`)."""
        return {route for s in self.samplers for _, route in s.outstanding.values()
                if route is not None}

    def take_failed(self) -> list[tuple[int, EngineError]]:
        """Requests of lost sampler ranks, failed UNAVAILABLE, not yet answered."""
        with self.lock:
            failed, self._failed = self._failed, []
        return failed

    def none_left(self) -> str:
        lost = [s.lost for s in self.samplers if s.lost is not None]
        return "sampling: no sampler rank is left" + (f"; {lost[-1]}" if lost else "")

    # ------------------------------------------------------------------ calls

    def call_all(self, calls: dict[SamplerEnd, tuple]) -> list[tuple[SamplerEnd, Any]]:
        """Send each sampler rank its call, then read every answer as it comes; a rank
        whose channel fails is lost and left out."""
        held = list(calls)
        for sampler in held:
            sampler.calls_lock.acquire()
        try:
            sent = [s for s in held if self._send(s, calls[s])]
            for sampler in [s for s in held if s not in sent]:
                sampler.calls_lock.release()
                held.remove(sampler)
            reading = {self._readers.submit(self._receive, s): s for s in sent}
            answers = []
            for future in as_completed(reading):
                sampler = reading[future]
                sampler.calls_lock.release()
                held.remove(sampler)
                if (answer := future.result()) is not None:
                    answers.append((sampler, answer))
            return answers
        finally:
            for sampler in held:
                sampler.calls_lock.release()

    def call(self, sampler: SamplerEnd, message: tuple) -> Any:
        """One call and its answer; UNAVAILABLE when the rank is lost on the way."""
        with sampler.calls_lock:
            answer = self._receive(sampler) if self._send(sampler, message) else None
        if answer is None:
            raise Unavailable(sampler.lost or self.none_left())
        return answer

    def _send(self, sampler: SamplerEnd, message: tuple) -> bool:
        try:
            sampler.link.calls.send(message)
            sampler.last_call = time.monotonic()
            return True
        except Exception as exc:
            self.lose(sampler, exc)
            return False

    def _receive(self, sampler: SamplerEnd) -> tuple[str, Any] | None:
        """(status, value) of the call just sent, or None when the channel failed."""
        try:
            status, value, stats = sampler.link.calls.receive(src=sampler.rank)
        except Exception as exc:
            self.lose(sampler, exc)
            return None
        sampler.stats = stats
        return status, value

    # ------------------------------------------------------------------ weights

    def post(self, message: tuple) -> None:
        """Queue a weights message (a publication, a release) for every sampler rank left,
        in the order posted."""
        for sampler in self.alive():
            sampler.outbox.put(message)

    def _send_weights(self, sampler: SamplerEnd) -> None:
        """The rank's weights channel: its outbox in order, a no-op when idle."""
        channel = sampler.link.weights
        while sampler.lost is None:
            try:
                message = sampler.outbox.get(timeout=self.interval_s)
            except queue.Empty:
                message = (NOOP,)
            try:
                channel.send(message)
            except Exception as exc:
                self.lose(sampler, exc)
                return
            if message[0] == STOP:
                return

    def _keep_calls_alive(self, sampler: SamplerEnd) -> None:
        while not self._closed.wait(self.interval_s / 2) and sampler.lost is None:
            if (time.monotonic() - sampler.last_call < self.interval_s
                    or not sampler.calls_lock.acquire(blocking=False)):
                continue
            try:
                self._send(sampler, (NOOP,))
            finally:
                sampler.calls_lock.release()

    # ------------------------------------------------------------------ health

    def lose(self, sampler: SamplerEnd, exc: BaseException) -> None:
        """The channel to `sampler` failed: its requests end UNAVAILABLE naming it
        (`take_failed`), and nothing is sent to it again."""
        with self.lock:
            if sampler.lost is not None:
                return
            left = sum(s.lost is None for s in self.samplers) - 1
            sampler.lost = (f"sampling: sampler rank {sampler.rank} is lost "
                            f"({type(exc).__name__}: {str(exc)[:300]}); its requests failed, "
                            f"{left} sampler rank{'s' if left != 1 else ''} left")
            self._failed += [(key, Unavailable(sampler.lost))
                             for key in sampler.outstanding if key >= 0]
            sampler.outstanding.clear()
        log.error("%s", sampler.lost)

    def stats(self) -> PoolStats:
        """The live sampler ranks' pools together: counters and state summed."""
        every = [s.stats for s in self.alive()]
        return PoolStats(**{f.name: sum(getattr(s, f.name) for s in every)
                            for f in fields(PoolStats)})

    def close(self) -> None:
        """Tell the sampler ranks still reachable to stop, on both channels."""
        self._closed.set()
        for sampler in self.alive():
            with sampler.calls_lock:
                self._send(sampler, (STOP,))
            sampler.outbox.put((STOP,))
        for thread in self._threads:
            thread.join(self.timeout_s)
        self._readers.shutdown(wait=False)
