"""Ordering and merging of ops: per-queue `seq_id` order, one compute worker.

Each training model (and each sampling session) has a queue. An op runs only after every
lower `seq_id` of its queue has finished, whatever order the RPCs arrive in; a retried
`seq_id` gets the stored result without running again. One worker thread takes the
ready head of every queue and hands a batch to the executor (the engine glue):

- `merged`: heads of different queues that share a `merge_group` ('forward', 'sample')
  go into one batch up to a token budget: one base-model pass serves many tenants;
- `timeshare`: one queue per batch, queues in turn (what other multi-LoRA servers do;
  the benchmarks' baseline).

Ops with `merge_group=None` (optimizer steps, saves, loads) always run alone, so they fall
between passes. A queue has at most one op in flight, so two ops of one queue never share
a batch and an `optim_step` never overtakes its model's `forward_backward`.

Sampling is continuous when the scheduler is given a `decode_group`: ops of that merge
group leave their queue as soon as they are its ready head and join the executor's
decode pool (`Executor.decode`), where they decode in bounded slices, many requests at
once, each answered the slice it finishes. An unordered one (a sampling session's) frees
its queue at once, so every request of a session decodes together; an ordered one (a
live model's, by seq_id) holds its queue until answered, as any op does. While rows
decode, the worker alternates training batches and decode slices
(`planning.plan_work`): a training op waits at most about one slice
(`decode_slice_s`), and a stream of training ops gets a slice between each of its
batches, so neither starves the other; with nothing decoding, new sample ops and
training ops go in arrival order. Decode batches are sized by the pool's rows and
KV memory (`engine.sampling.pool`), not by `token_budget`. With `decode_apart` (a
model whose sampler ranks decode apart from its trainer ranks) a second worker runs the
decode slices, so neither kind of work waits for the other.

A caller that stops waiting (`cancel`: an HTTP future cancelled by the SDK's
`cancel_future`, a gRPC client gone away) cancels a sample op of the decode pool: still
queued, it is answered with `Cancelled` and never runs (an ordered one still takes its
seq_id in its turn); in the pool, the executor ends it at the next slice. Every other op
runs as if its caller still waited (`planning.plan_cancel` says why).

The decisions which ready ops run together, what runs next and what a cancel does are
the pure functions `planning.plan_batch`, `planning.plan_work` and
`planning.plan_cancel`; this class adds one lock, one condition variable and one
thread. Futures are resolved outside the lock, because resolving runs the callers'
callbacks (asyncio's `wrap_future` among them). This module imports neither torch nor
grpc.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from twinkle_server.engine.errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from twinkle_server.scheduling.planning import (
    DEFAULT_DECODE_SLICE_S,
    DEFAULT_TOKEN_BUDGET,
    MODES,
    Mode,
    Op,
    Place,
    Work,
    plan_batch,
    plan_cancel,
    plan_work,
)

# How far ahead of the next expected seq an op may arrive: bounds what one client can park
# in server memory while an earlier seq_id is missing.
MAX_SEQ_AHEAD = 1024
DEFAULT_RESULT_CACHE_SIZE = 256


class SchedulerClosed(Unavailable):
    """The server is shutting down; the op was not run."""


class OutOfOrder(FailedPrecondition):
    """The op's seq_id can never run (too old and forgotten, too far ahead, or reused)."""


class UnknownQueue(NotFound):
    """No model or sampling session with this id is registered."""


class Executor(Protocol):
    """What the worker calls: the engine glue (`scheduling.executor`) or a test fake."""

    def run_batch(self, ops: Sequence[Op]) -> Sequence[Any]:
        """One result per op, in order; a per-op failure is returned as an exception value.

        Raising fails every op of the batch with that exception.
        """

    def decode(self, joining: Sequence[Op], slice_s: float, cancelled: Sequence[Op] = ()
               ) -> Sequence[tuple[Op, Any]]:
        """One decode slice of about `slice_s` seconds, `joining` new to the pool; the ops
        finished in it (any earlier joiner's too), each with its result or exception.
        `cancelled` are ops of earlier calls that must leave the pool now, waiting or
        decoding: each comes back finished, with a `Cancelled` result unless it had
        already finished. Only called when the scheduler has a `decode_group`.

        Raising fails every op in the pool with that exception.
        """


class _OpFuture(Future):
    """A future its caller cannot cancel.

    An ordered op keeps its place even when the caller stops waiting (an RPC cancelled
    by a disconnect cancels its `wrap_future`): later seq_ids of the queue wait on it, and
    a retry of the same seq_id shares this future and must get the real result. A caller
    that stops waiting says so with `Scheduler.cancel`, which decides what to stop.
    """

    def cancel(self) -> bool:
        return False


@dataclass(eq=False)
class _Entry:
    op: Op
    future: _OpFuture
    # Arrival number: orders a queue's ordered and unordered ops against each other.
    ticket: int
    arrived: float = field(default_factory=time.monotonic)
    # Callers sharing the future (retries of its seq_id): cancelled when all went away.
    waiters: int = 1
    # Answered `Cancelled`; an ordered one still takes its seq_id in its turn.
    cancelled: bool = False


@dataclass(eq=False)
class _Queue:
    next_seq: int
    pending: dict[int, _Entry] = field(default_factory=dict)
    unordered: deque[_Entry] = field(default_factory=deque)
    running: _Entry | None = None
    done: OrderedDict[int, _Entry] = field(default_factory=OrderedDict)

    def head(self) -> _Entry | None:
        """The op this queue would run next, or None while one runs or none is ready."""
        if self.running is not None:
            return None
        ordered = self.pending.get(self.next_seq)
        loose = self.unordered[0] if self.unordered else None
        if ordered is None or loose is None:
            return ordered or loose
        return ordered if ordered.ticket < loose.ticket else loose

    def take_waiting(self) -> list[_Entry]:
        """Remove and return every op not yet running."""
        waiting = list(self.pending.values()) + list(self.unordered)
        self.pending.clear()
        self.unordered.clear()
        return waiting


class Scheduler:
    """Per-queue ordering, idempotent retries and one worker that batches ready heads.

    Args:
        executor: runs each batch on the worker thread.
        mode: 'merged' (ops of different queues share a pass) or 'timeshare' (one op
            per batch, queues in turn).
        token_budget: most `Op.tokens` in one merged batch (a single larger op still runs).
        result_cache_size: finished results kept per queue for retried seq_ids.
        decode_group: the merge group whose ops decode continuously (`Executor.decode`);
            None runs them as batches like any other group.
        decode_slice_s: how long one decode slice runs while training ops wait.
        decode_apart: decode slices run on a second worker thread, beside training
            batches instead of between them: for an executor whose decoding runs on
            other devices than its training (sampler ranks, `twinkle_server.ranks.split`).

    Example:
        >>> sched = Scheduler(executor); sched.register_model("run-1"); sched.start()
        >>> sched.submit(Op("run-1", 0, "forward", "forward", 128, payload)).result()
    """

    def __init__(self, executor: Executor, mode: Mode = "merged",
                 token_budget: int = DEFAULT_TOKEN_BUDGET,
                 result_cache_size: int = DEFAULT_RESULT_CACHE_SIZE,
                 decode_group: str | None = None,
                 decode_slice_s: float = DEFAULT_DECODE_SLICE_S,
                 decode_apart: bool = False) -> None:
        if mode not in MODES:
            raise InvalidArgument(f"scheduling: {mode!r} is not one of {', '.join(MODES)}")
        if token_budget < 1:
            raise InvalidArgument(f"token_budget: {token_budget} must be at least 1")
        if result_cache_size < 0:
            raise InvalidArgument(f"result_cache_size: {result_cache_size} must be at least 0")
        if not decode_slice_s > 0:
            raise InvalidArgument(f"decode_slice_s: {decode_slice_s} must be above 0")
        if decode_apart and decode_group is None:
            raise InvalidArgument("decode_apart: needs a decode_group (continuous sampling)")
        self.executor = executor
        self.mode: Mode = mode
        self.token_budget = token_budget
        self.result_cache_size = result_cache_size
        self._queues: dict[str, _Queue] = {}
        self._order: list[str] = []
        self._cursor = 0
        self._tickets = 0
        self._cond = threading.Condition()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._ops_run = 0
        self._batches_run = 0
        self._merged_ops = 0
        self.decode_group = decode_group
        self.decode_slice_s = decode_slice_s
        self.decode_apart = decode_apart
        self._trained_out = False   # the training worker has stopped (decode_apart)
        # Decode ops taken from their queues: not yet handed to the pool, and in it.
        self._joining: list[tuple[_Queue, _Entry]] = []
        self._decoding: dict[int, tuple[_Queue, _Entry]] = {}
        # Ops in the pool whose callers went away: the next slice ends them.
        self._stopping: list[Op] = []
        self._last: Work | None = None
        self._slices_run = 0
        # Per op kind: ops started, and their seconds from arrival to start, summed.
        self._waits: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the worker thread (two with `decode_apart`); a second call does nothing.

        Raises:
            SchedulerClosed: the scheduler was already stopped.
        """
        with self._cond:
            if self._closed:
                raise SchedulerClosed("start: the scheduler was stopped; build a new one")
            if self._threads:
                return
            works: list[Work | None] = ["train", "decode"] if self.decode_apart else [None]
            self._threads = [threading.Thread(target=self._work, args=(only,), daemon=True,
                                              name=f"twinkle-{only or 'compute'}")
                             for only in works]
            for thread in self._threads:
                thread.start()

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Refuse new ops with `SchedulerClosed`; with `drain` finish queued ones first.

        Without `drain` (or when the worker never started) every op not yet running fails
        with `SchedulerClosed`. Draining ends when no op is ready: ops still waiting for an
        earlier seq_id that never came then fail. If `timeout` seconds pass first, what
        is still waiting fails and the worker exits after its current batch.
        """
        with self._cond:
            self._closed = True
            threads = list(self._threads)
            failed = [] if drain and threads else self._take_all_waiting()
            self._cond.notify_all()
        _fail_all(failed, SchedulerClosed("the server is shutting down; the op was not run"))
        if not threads:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            with self._cond:
                failed = self._take_all_waiting()
            _fail_all(failed, SchedulerClosed(
                f"the server stopped draining after {timeout} s; the op was not run"))

    def _take_all_waiting(self) -> list[_Entry]:
        joining, self._joining = [entry for _, entry in self._joining], []
        return joining + [e for queue in self._queues.values() for e in queue.take_waiting()]

    # ------------------------------------------------------------------ queues

    def register_model(self, queue_id: str, next_seq: int = 0) -> None:
        """Create the queue `queue_id`, whose first ordered op is `next_seq`.

        Registering an id that exists does nothing (its queue and next seq are kept).
        """
        if next_seq < 0:
            raise InvalidArgument(f"next_seq: {next_seq} must be at least 0")
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
            index = self._order.index(queue_id)
            del self._order[index]
            # Keep the rotation pointing at the same next queue.
            if index < self._cursor:
                self._cursor -= 1
            failed = queue.take_waiting()
        _fail_all(failed, reason)

    def next_seq(self, queue_id: str) -> int:
        """The seq_id the queue runs next (what a reconnecting client should send).

        Raises:
            UnknownQueue: no such queue.
        """
        with self._cond:
            queue = self._queues.get(queue_id)
            if queue is None:
                raise UnknownQueue(_unknown(queue_id))
            return queue.next_seq

    def submit(self, op: Op) -> Future:
        """Queue `op`; returns at once with a future of the executor's result.

        A seq_id that is queued, running or finished (and still cached) returns that op's
        future. Refusals come back as failed futures: `SchedulerClosed`, `UnknownQueue`,
        `OutOfOrder`.
        """
        with self._cond:
            fut = _OpFuture()
            error = self._admit(op, fut)
            if isinstance(error, _OpFuture):
                return error
            if error is None:
                self._cond.notify_all()   # both workers, with decode_apart
                return fut
        fut.set_exception(error)
        return fut

    def _admit(self, op: Op, fut: _OpFuture) -> Exception | _OpFuture | None:
        """Queue `op` under `fut` (None), name why not, or return the future it shares."""
        if self._closed:
            return SchedulerClosed("the server is shutting down; not accepting ops")
        queue = self._queues.get(op.queue_id)
        if queue is None:
            return UnknownQueue(_unknown(op.queue_id))
        if op.tokens < 0:
            return InvalidArgument(f"tokens: {op.tokens} must be at least 0")
        self._tickets += 1
        entry = _Entry(op, fut, self._tickets)
        if op.seq_id is None:
            queue.unordered.append(entry)
            return None
        seq = op.seq_id
        running = queue.running if queue.running and queue.running.op.seq_id == seq else None
        existing = queue.done.get(seq) or running or queue.pending.get(seq)
        if existing is not None:
            if existing.op.kind != op.kind:
                return OutOfOrder(
                    f"seq_id: {seq} was already used by a {existing.op.kind} op; this "
                    f"{op.kind} needs a new seq_id (the model expects {queue.next_seq})")
            if not existing.future.done():
                existing.waiters += 1
            return existing.future
        if seq < 0:
            return InvalidArgument(f"seq_id: {seq} must be at least 0; the model expects "
                                   f"seq_id {queue.next_seq} next")
        if seq < queue.next_seq:
            return OutOfOrder(
                f"seq_id: {seq} already ran and its result is no longer kept; the model "
                f"expects seq_id {queue.next_seq} next")
        if seq > queue.next_seq + MAX_SEQ_AHEAD:
            return OutOfOrder(
                f"seq_id: {seq} is more than {MAX_SEQ_AHEAD} ahead of the expected "
                f"{queue.next_seq}")
        queue.pending[seq] = entry
        return None

    def cancel(self, future: Future) -> bool:
        """One caller of `submit` stops waiting for `future` (what `submit` gave it); call
        once per caller that goes away. When no caller is left, a sample op of the decode
        pool is cancelled (`planning.plan_cancel`): still queued, its future is answered
        with `Cancelled` now and it never runs (an ordered one still takes its seq_id in
        its turn); in the pool, the executor ends it at the next slice and its future gets
        `Cancelled` then. Any other op runs as if its caller still waited.

        Returns whether the op was cancelled (False: it runs on, or was already finished,
        cancelled, or never queued here).
        """
        with self._cond:
            found = self._locate(future)
            if found is None:
                return False
            place, queue, entry = found
            decode_op = self.decode_group is not None and entry.op.merge_group == self.decode_group
            action = plan_cancel(decode_op, place, entry.op.seq_id is not None)
            if action == "keep" or entry.cancelled:
                return False
            entry.waiters -= 1
            if entry.waiters > 0:
                return False
            entry.cancelled = True
            if action == "stop":
                self._stopping.append(entry.op)
                return True
            if place == "joining":
                self._joining.remove((queue, entry))
                self._retire(queue, entry)
            elif action == "drop":
                queue.unordered.remove(entry)
            # `skip`: it stays queued, and `_divert` takes its seq_id in its turn.
            self._cond.notify_all()
        entry.future.set_exception(_cancelled(entry.op))
        return True

    def _locate(self, future: Future) -> tuple[Place, _Queue, _Entry] | None:
        """Where the op of `future` is (call with the lock); None: not here."""
        for queue, entry in self._decoding.values():
            if entry.future is future:
                return "pool", queue, entry
        for queue, entry in self._joining:
            if entry.future is future:
                return "joining", queue, entry
        for queue in self._queues.values():
            if queue.running is not None and queue.running.future is future:
                return "running", queue, queue.running
            for entry in (*queue.pending.values(), *queue.unordered):
                if entry.future is future:
                    return "queued", queue, entry
        return None

    def stats(self) -> dict[str, Any]:
        """Counters for logs and benchmarks.

        `depths` maps each queue to its ops not yet running; `merged_ops` counts ops that
        ran in batches of two or more; `decoding` the sample ops in or joining the decode
        pool; `waits` per op kind, how many started and their seconds queued, summed.
        """
        with self._cond:
            depths = {q: len(v.pending) + len(v.unordered) for q, v in self._queues.items()}
            return {
                "mode": self.mode,
                "queues": len(self._queues),
                "depths": depths,
                "queued": sum(depths.values()),
                "running": sum(v.running is not None for v in self._queues.values()),
                "ops_run": self._ops_run,
                "batches_run": self._batches_run,
                "merged_ops": self._merged_ops,
                "decoding": len(self._decoding) + len(self._joining),
                "decode_slices": self._slices_run,
                "waits": {kind: (int(n), total) for kind, (n, total) in self._waits.items()},
            }

    # ------------------------------------------------------------------ worker

    def _ready_heads(self) -> tuple[list[_Entry], int]:
        """Ready heads in registration order, and the index of the first one at or after
        the rotation cursor (call with the lock)."""
        heads = []
        start = None
        for i, queue_id in enumerate(self._order):
            head = self._queues[queue_id].head()
            if head is not None:
                if start is None and i >= self._cursor:
                    start = len(heads)
                heads.append(head)
        return heads, start or 0

    def _take(self, only: Work | None = None
              ) -> tuple[Work, list[tuple[_Queue, _Entry]], list[Op]] | None:
        """Wait for work and claim it: a training batch, or the decode ops joining the
        next slice and the pool's ops to stop in it; None once closed and drained.
        `only`: this worker's one kind of work (`decode_apart`)."""
        stranded: list[_Entry] = []
        with self._cond:
            while True:
                if self._divert():
                    self._cond.notify_all()   # the decode worker may be waiting
                heads, start = self._ready_heads()
                decoding, joining = bool(self._decoding), bool(self._joining)
                if only == "train":
                    work: Work | None = "train" if heads else None
                    # Sample ops may still free a live model's queue for its next op.
                    done = self._closed and not (decoding or joining)
                elif only == "decode":
                    work = "decode" if decoding or joining else None
                    # The training worker may still move a sample into the pool (one
                    # queued behind its running op): stop after it.
                    done = self._closed and self._trained_out
                else:
                    first_sample = min((e.ticket for _, e in self._joining), default=None)
                    training_first = bool(heads) and (
                        first_sample is None or min(e.ticket for e in heads) < first_sample)
                    work = plan_work(bool(heads), decoding, joining, self._last,
                                     training_first)
                    done = self._closed
                if work is not None or done:
                    break
                self._cond.wait()
            if work == "train":
                return work, self._claim(heads, start), []
            if work == "decode":
                joining, self._joining = self._joining, []
                for queue, entry in joining:
                    self._decoding[id(entry.op)] = queue, entry
                # One that finished since its cancel is no longer the pool's.
                stopping = [op for op in self._stopping if id(op) in self._decoding]
                self._stopping = []
                return work, joining, stopping
            if only == "decode":   # the training worker strands what is left
                return None
            # Closed with nothing ready (this worker runs nothing now): what is left
            # waits on a seq_id that never came.
            for queue in self._queues.values():
                stranded += queue.take_waiting()
            self._trained_out = True
            self._cond.notify_all()
        _fail_all(stranded, SchedulerClosed("the server shut down before this op's earlier "
                                            "seq_ids arrived; it was not run"))
        return None

    def _divert(self) -> bool:
        """Move every ready head of the decode group off its queue to join the decode pool
        (call with the lock); an unordered one leaves its queue free for the next. A
        cancelled ordered head was answered already: it only takes its seq_id. Returns
        whether any moved."""
        if self.decode_group is None:
            return False
        moved, any_moved = True, False
        while moved:
            moved = False
            for queue_id in self._order:
                queue = self._queues[queue_id]
                head = queue.head()
                if head is None or head.op.merge_group != self.decode_group:
                    continue
                moved = any_moved = True
                if head.op.seq_id is None:
                    queue.unordered.popleft()
                else:
                    del queue.pending[head.op.seq_id]
                    if head.cancelled:
                        self._retire(queue, head)
                        continue
                    queue.running = head
                self._started(head)
                self._joining.append((queue, head))
        return any_moved

    def _started(self, entry: _Entry) -> None:
        wait = self._waits.setdefault(entry.op.kind, [0, 0.0])
        wait[0] += 1
        wait[1] += time.monotonic() - entry.arrived

    def _claim(self, heads: list[_Entry], start: int) -> list[tuple[_Queue, _Entry]]:
        """Mark the planned ops running (call with the lock)."""
        ops = plan_batch([e.op for e in heads], self.mode, self.token_budget, start)
        by_op = {id(e.op): e for e in heads}
        chosen = []
        for op in ops:
            entry = by_op[id(op)]
            queue = self._queues[op.queue_id]
            if op.seq_id is None:
                queue.unordered.popleft()
            else:
                del queue.pending[op.seq_id]
            queue.running = entry
            self._started(entry)
            chosen.append((queue, entry))
        # The queue after the batch's first one leads the next rotation.
        self._cursor = (self._order.index(ops[0].queue_id) + 1) % len(self._order)
        return chosen

    def _work(self, only: Work | None = None) -> None:
        while True:
            taken = self._take(only)
            if taken is None:
                return
            work, chosen, stopping = taken
            if work == "train":
                self._finish(chosen, self._run([entry.op for _, entry in chosen]))
            else:
                self._finish(*self._run_decode([entry.op for _, entry in chosen], stopping),
                             batch=False)
            self._last = work

    def _run_decode(self, joining: list[Op], stopping: list[Op]
                    ) -> tuple[list[tuple[_Queue, _Entry]], list[Any]]:
        """One decode slice: the entries it finished and their results. A slice that
        raises fails every op in the pool (its state is then unknown); an op the
        scheduler does not hold (answered already) is passed over."""
        try:
            done = [(op, result) for op, result in
                    self.executor.decode(joining, self.decode_slice_s, stopping)]
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else _wrapped(exc)
            with self._cond:
                finished = [(pair, error) for pair in self._decoding.values()]
                self._decoding.clear()
                self._stopping.clear()
                self._slices_run += 1
        else:
            with self._cond:
                finished = [(self._decoding.pop(id(op)), result) for op, result in done
                            if id(op) in self._decoding]
                self._slices_run += 1
        return [pair for pair, _ in finished], [result for _, result in finished]

    def _run(self, ops: list[Op]) -> list[Any]:
        """The executor's results, one per op; whatever it does becomes per-op values."""
        n = len(ops)
        try:
            raw = self.executor.run_batch(ops)
        except Exception as exc:
            return [exc] * n
        except BaseException as exc:  # the worker outlives even SystemExit from an op
            return [_wrapped(exc)] * n
        try:
            results = list(raw)
        except TypeError:
            error = RuntimeError(f"executor: run_batch returned {type(raw).__name__}, not "
                                 f"a sequence of {n} results")
            return [error] * n
        if len(results) != n:
            kinds = ", ".join(op.kind for op in ops)
            error = RuntimeError(f"executor: run_batch returned {len(results)} results for "
                                 f"{n} ops ({kinds}); none of them is trusted")
            return [error] * n
        return results

    def _retire(self, queue: _Queue, entry: _Entry) -> None:
        """The op is over: free its queue, and an ordered one takes its seq_id (kept for
        retries); call with the lock. `queue` may be unregistered by now; updating the
        orphan is harmless."""
        if queue.running is entry:
            queue.running = None
        seq = entry.op.seq_id
        if seq is not None:
            queue.next_seq = seq + 1
            if self.result_cache_size:
                queue.done[seq] = entry
                while len(queue.done) > self.result_cache_size:
                    queue.done.popitem(last=False)

    def _finish(self, chosen: list[tuple[_Queue, _Entry]], results: list[Any],
                batch: bool = True) -> None:
        """Answer `chosen` with `results`; `batch` False: they finished in a decode slice."""
        with self._cond:
            self._ops_run += len(chosen)
            if batch:
                self._batches_run += 1
                if len(chosen) > 1:
                    self._merged_ops += len(chosen)
            for queue, entry in chosen:
                self._retire(queue, entry)
            self._cond.notify_all()
        for (_, entry), result in zip(chosen, results, strict=True):
            if entry.future.done():
                continue
            if entry.cancelled and isinstance(result, Cancelled):
                result = _cancelled(entry.op, result)   # why, and what a retry gets
            if isinstance(result, Exception):
                entry.future.set_exception(result)
            elif isinstance(result, BaseException):
                entry.future.set_exception(_wrapped(result))
            else:
                entry.future.set_result(result)


def _unknown(queue_id: str) -> str:
    return f"model_id: no model or sampling session {queue_id!r} is registered"


def _cancelled(op: Op, cause: BaseException | None = None) -> Cancelled:
    seq = "" if op.seq_id is None else (f" (seq_id {op.seq_id} is taken: a retry of it gets "
                                        "this answer)")
    error = Cancelled(f"{op.kind}: cancelled before it finished: its caller stopped waiting "
                      f"(cancel_future, or the client went away){seq}")
    error.__cause__ = cause
    return error


def _wrapped(exc: BaseException) -> RuntimeError:
    """A non-`Exception` (SystemExit, KeyboardInterrupt) must not escape into callers."""
    error = RuntimeError(f"executor: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _fail_all(entries: list[_Entry], exc: BaseException) -> None:
    for entry in entries:
        if not entry.future.done():
            entry.future.set_exception(exc)
