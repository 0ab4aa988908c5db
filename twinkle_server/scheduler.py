"""Ordering and merging of ops: per-queue `seq_id` order, one compute worker.

Each training model (and each sampling session) has a queue. An op runs only after every
lower `seq_id` of its queue has finished, whatever order the RPCs arrive in; a retried
`seq_id` gets the stored result without running again. One worker thread takes the
ready head of every queue and hands a batch to the executor (the engine glue):

- `merged`: heads of different queues that share a `merge_group` ('forward', 'sample')
  go into one batch up to a token budget: one base-model pass serves many tenants;
- `timeshare`: one queue per batch, queues in turn (what other multi-LoRA servers do;
  the benchmarks' baseline).

Ops with `merge_group=None` (optimizer steps, saves, loads) always run alone. The
decisions are the pure function `plan_batch`; the class only adds locking and threads.
This module imports neither torch nor grpc.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Mode = Literal["merged", "timeshare"]
# How far ahead of the next expected seq an op may arrive: bounds what a client can park.
MAX_SEQ_AHEAD = 1024
# Tokens per merged pass. Past ~8k tokens a CPU pass is memory-bound and merging more
# rows stops paying (bench/engine.py measured 8 x 8 x 512 merged at 0.36x timeshare).
DEFAULT_TOKEN_BUDGET = 8192


class SchedulerClosed(Exception):
    """The server is shutting down; the op was not run."""


class OutOfOrder(Exception):
    """The op's seq_id can never run (too old and forgotten, or too far ahead)."""


class UnknownQueue(Exception):
    """No model or sampling session with this id is registered."""


@dataclass(frozen=True)
class Op:
    """One unit of work for the executor; `payload` is opaque to the scheduler."""

    queue_id: str
    seq_id: int | None
    kind: str
    merge_group: str | None
    tokens: int
    payload: Any
    request_id: str = ""


class Executor(Protocol):
    def run_batch(self, ops: Sequence[Op]) -> Sequence[Any]:
        """One result per op, in order; a per-op failure is returned as an exception value."""


def plan_batch(heads: Sequence[Op], mode: Mode, token_budget: int) -> list[Op]:
    """Which of the ready heads (one per queue, in rotation order) run together now.

    The first head always runs. In merged mode, later heads of other queues join it when
    they share its merge group and the batch stays within `token_budget`.
    """
    if not heads:
        return []
    first = heads[0]
    batch = [first]
    if mode == "timeshare" or first.merge_group is None:
        return batch
    tokens = first.tokens
    seen = {first.queue_id}
    for op in heads[1:]:
        if op.merge_group != first.merge_group or op.queue_id in seen:
            continue
        if tokens + op.tokens > token_budget:
            continue
        batch.append(op)
        tokens += op.tokens
        seen.add(op.queue_id)
    return batch


@dataclass
class _Queue:
    next_seq: int
    pending: dict[int, tuple[Op, Future]] = field(default_factory=dict)
    unordered: list[tuple[Op, Future]] = field(default_factory=list)
    running: dict[int, Future] = field(default_factory=dict)
    done: OrderedDict[int, Future] = field(default_factory=OrderedDict)
    busy: bool = False

    def head(self) -> tuple[Op, Future] | None:
        if self.busy:
            return None
        if self.next_seq in self.pending:
            return self.pending[self.next_seq]
        if self.unordered:
            return self.unordered[0]
        return None


class Scheduler:
    """Per-queue ordering, idempotent retries and one worker that batches ready heads."""

    def __init__(self, executor: Executor, mode: Mode = "merged",
                 token_budget: int = DEFAULT_TOKEN_BUDGET,
                 result_cache_size: int = 256) -> None:
        if mode not in ("merged", "timeshare"):
            raise ValueError(f"scheduling: {mode!r} is not 'merged' or 'timeshare'")
        self.executor = executor
        self.mode: Mode = mode
        self.token_budget = token_budget
        self.result_cache_size = result_cache_size
        self._queues: dict[str, _Queue] = {}
        self._order: list[str] = []
        self._cursor = 0
        self._cond = threading.Condition()
        self._closed = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._stats = {"ops": 0, "batches": 0, "merged_ops": 0}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="twinkle-compute", daemon=True)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new ops; with `drain` finish queued ones, else fail them."""
        failed: list[Future] = []
        with self._cond:
            self._closed = True
            if not drain:
                for queue in self._queues.values():
                    failed += [f for _, f in queue.pending.values()]
                    failed += [f for _, f in queue.unordered]
                    queue.pending.clear()
                    queue.unordered.clear()
            self._stopping = True
            self._cond.notify_all()
        for fut in failed:
            _fail(fut, SchedulerClosed("the server is shutting down; the op was not run"))
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ queues

    def register_model(self, queue_id: str, next_seq: int = 0) -> None:
        with self._cond:
            if queue_id not in self._queues:
                self._queues[queue_id] = _Queue(next_seq=next_seq)
                self._order.append(queue_id)

    def unregister(self, queue_id: str, reason: Exception) -> None:
        """Forget a queue; its waiting ops fail with `reason` (a running op finishes)."""
        with self._cond:
            queue = self._queues.pop(queue_id, None)
            if queue is None:
                return
            self._order.remove(queue_id)
            failed = [f for _, f in queue.pending.values()] + [f for _, f in queue.unordered]
        for fut in failed:
            _fail(fut, reason)

    def next_seq(self, queue_id: str) -> int:
        with self._cond:
            queue = self._queues.get(queue_id)
            if queue is None:
                raise UnknownQueue(f"model_id: no model or sampling session {queue_id!r}")
            return queue.next_seq

    def submit(self, op: Op) -> Future:
        """Queue `op`; returns at once with a future of the executor's result."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                _fail(fut, SchedulerClosed("the server is shutting down; not accepting ops"))
                return fut
            queue = self._queues.get(op.queue_id)
            if queue is None:
                _fail(fut, UnknownQueue(f"model_id: no model or sampling session "
                                        f"{op.queue_id!r}"))
                return fut
            if op.seq_id is None:
                queue.unordered.append((op, fut))
                self._cond.notify()
                return fut
            seq = op.seq_id
            existing = (queue.done.get(seq) or queue.running.get(seq)
                        or (queue.pending[seq][1] if seq in queue.pending else None))
            if existing is not None:
                return existing
            if seq < queue.next_seq:
                _fail(fut, OutOfOrder(
                    f"seq_id: {seq} already ran and its result is no longer kept; the model "
                    f"expects seq_id {queue.next_seq} next"))
                return fut
            if seq > queue.next_seq + MAX_SEQ_AHEAD:
                _fail(fut, OutOfOrder(
                    f"seq_id: {seq} is more than {MAX_SEQ_AHEAD} ahead of the expected "
                    f"{queue.next_seq}"))
                return fut
            queue.pending[seq] = (op, fut)
            self._cond.notify()
        return fut

    def stats(self) -> dict[str, Any]:
        with self._cond:
            depths = {q: len(v.pending) + len(v.unordered) for q, v in self._queues.items()}
            return {**self._stats, "queues": len(self._queues), "queued": sum(depths.values()),
                    "depths": depths}

    # ------------------------------------------------------------------ worker

    def _ready_heads(self) -> list[tuple[Op, Future]]:
        """Ready heads in rotation order starting at the cursor (call with the lock)."""
        n = len(self._order)
        heads = []
        for i in range(n):
            queue_id = self._order[(self._cursor + i) % n]
            head = self._queues[queue_id].head()
            if head is not None:
                heads.append(head)
        return heads

    def _take(self) -> list[tuple[Op, Future]] | None:
        """Wait for ready heads and claim a batch of them; None once stopped and drained."""
        stranded: list[Future] = []
        with self._cond:
            heads = self._ready_heads()
            while not heads:
                if self._stopping and not any(q.busy for q in self._queues.values()):
                    # Draining is over: what is left waits on a seq_id that never came.
                    for queue in self._queues.values():
                        stranded += [f for _, f in queue.pending.values()]
                        queue.pending.clear()
                    break
                self._cond.wait()
                heads = self._ready_heads()
            chosen = self._claim(heads) if heads else None
        for fut in stranded:
            _fail(fut, SchedulerClosed("the server shut down before this op's earlier "
                                       "seq_ids arrived; it was not run"))
        return chosen

    def _claim(self, heads: list[tuple[Op, Future]]) -> list[tuple[Op, Future]]:
        """Mark the planned ops running (call with the lock)."""
        ops = plan_batch([op for op, _ in heads], self.mode, self.token_budget)
        chosen = [next(h for h in heads if h[0] is op) for op in ops]
        for op, fut in chosen:
            queue = self._queues[op.queue_id]
            queue.busy = True
            if op.seq_id is None:
                queue.unordered.pop(0)
            else:
                del queue.pending[op.seq_id]
                queue.running[op.seq_id] = fut
        self._cursor = (self._order.index(chosen[0][0].queue_id) + 1) % len(self._order)
        return chosen

    def _work(self) -> None:
        while True:
            chosen = self._take()
            if chosen is None:
                return
            ops = [op for op, _ in chosen]
            try:
                results = list(self.executor.run_batch(ops))
                if len(results) != len(ops):
                    error = RuntimeError(f"executor returned {len(results)} results for "
                                         f"{len(ops)} ops")
                    results = [error] * len(ops)
            except Exception as exc:  # the worker must outlive any executor failure
                results = [exc] * len(ops)
            self._finish(chosen, results)

    def _finish(self, chosen: list[tuple[Op, Future]], results: list[Any]) -> None:
        with self._cond:
            self._stats["ops"] += len(chosen)
            self._stats["batches"] += 1
            if len(chosen) > 1:
                self._stats["merged_ops"] += len(chosen)
            for op, fut in chosen:
                queue = self._queues.get(op.queue_id)
                if queue is None:
                    continue
                queue.busy = False
                if op.seq_id is not None:
                    queue.running.pop(op.seq_id, None)
                    queue.done[op.seq_id] = fut
                    queue.next_seq = op.seq_id + 1
                    while len(queue.done) > self.result_cache_size:
                        queue.done.popitem(last=False)
            self._cond.notify_all()
        for (_, fut), result in zip(chosen, results, strict=True):
            if isinstance(result, BaseException):
                _fail(fut, result)
            else:
                fut.set_result(result)


def _fail(fut: Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
