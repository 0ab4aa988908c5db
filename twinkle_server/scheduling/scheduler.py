"""The scheduler: per-queue `seq_id` order, one compute worker, and its drain.

Each training model (and each sampling session) has a queue (`scheduling.queues`: order,
retries). One worker thread takes the ready head of every queue and hands a batch to the
executor (the engine glue):

- `merged`: heads of different queues that share a `merge_group` ('forward', 'sample')
  go into one batch up to a token budget: one base-model pass serves many tenants;
- `timeshare`: one queue per batch, queues in turn (what other multi-LoRA servers do;
  the benchmarks' baseline).

Ops with `merge_group=None` (optimizer steps, saves, loads) always run alone, so they fall
between passes. Given a `decode_group`, sampling is continuous: ops of that group join
the executor's decode pool (`scheduling.decode_lane`), and while rows decode the worker
alternates training batches and decode slices (`planning.plan_work`), so a training op
waits at most about one slice (`decode_slice_s`) and neither kind starves the other.
Decode batches are sized by the pool's rows and KV memory, not by `token_budget`. With
`decode_apart` (sampler ranks that decode apart from the trainer ranks) a second worker
runs the slices. A caller that stops waiting (`cancel`) cancels a sample op of the pool;
every other op runs as if its caller still waited (`planning.plan_cancel` says why).

`stop` drains: new ops are refused, queued ones run while any is ready, and what still
waits then (on an earlier seq_id that never came, or past the timeout) fails with
`SchedulerClosed`. The drain is the worker's own end, so it lives here beside it.

The decisions are the pure functions of `planning`; this class adds one lock, one
condition variable and one thread. Futures are resolved outside the lock, because
resolving runs the callers' callbacks (asyncio's `wrap_future` among them); how each is
answered is `answers`'. This module imports neither torch nor grpc.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.scheduling.answers import (
    answer,
    batch_results,
    cancelled,
    fail_all,
    tell,
    wrapped,
)
from twinkle_server.scheduling.decode_lane import DecodeLane
from twinkle_server.scheduling.planning import (
    DEFAULT_DECODE_SLICE_S,
    DEFAULT_TOKEN_BUDGET,
    MODES,
    Mode,
    Op,
    Place,
    Slots,
    Work,
    plan_batch,
    plan_cancel,
    plan_work,
)
from twinkle_server.scheduling.queues import (
    DEFAULT_RESULT_CACHE_SIZE,
    Entry,
    OpFuture,
    Queue,
    QueueLimits,
    Queues,
    SchedulerClosed,
)


class Executor(Protocol):
    """What the worker calls: the engine glue (`scheduling.executor`) or a test fake."""

    def run_batch(self, ops: Sequence[Op]) -> Sequence[Any]:
        """One result per op, in order; a per-op failure is returned as an exception value.

        Raising fails every op of the batch with that exception.
        """

    def decode(self, joining: Sequence[tuple[int, Op]], slice_s: float,
               cancelled: Sequence[int] = ()) -> Sequence[tuple[int, Any]]:
        """One decode slice of about `slice_s` seconds, `joining` new to the pool, each
        under its key; the keys of the ops finished in it (any earlier joiner's too),
        each with its result or exception. `cancelled` are keys of earlier calls' ops
        that must leave the pool now, waiting or decoding: each comes back finished,
        with a `Cancelled` result unless it had already finished (or the pool no longer
        holds it). Only called when the scheduler has a `decode_group`.

        Raising fails every op in the pool with that exception.
        """


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
        limits: how many ops, and bytes of them, a tenant and all tenants may have
            waiting (queued or in the decode pool); past them `submit` refuses. None:
            no bound.
        slots: the executor's adapter slots now, asked as each batch is planned, so that
            a merged batch prefers resident adapters and fits the slots (`plan_batch`).
            None: batches ignore residency.

    Example:
        >>> sched = Scheduler(executor); sched.register_model("run-1"); sched.start()
        >>> sched.submit(Op("run-1", 0, "forward", "forward", 128, payload)).result()
    """

    def __init__(self, executor: Executor, mode: Mode = "merged",
                 token_budget: int = DEFAULT_TOKEN_BUDGET,
                 result_cache_size: int = DEFAULT_RESULT_CACHE_SIZE,
                 decode_group: str | None = None,
                 decode_slice_s: float = DEFAULT_DECODE_SLICE_S,
                 decode_apart: bool = False, limits: QueueLimits | None = None,
                 slots: Callable[[], Slots] | None = None) -> None:
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
        self.limits = limits
        self._slots = slots
        self.mode: Mode = mode
        self.token_budget = token_budget
        self._queues = Queues(result_cache_size)
        self._lane = DecodeLane(decode_group)
        self._cond = threading.Condition()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._ops_run = 0
        self._batches_run = 0
        self._merged_ops = 0
        # Passes of a merge group by how many tenants' ops they carried (never whose).
        self._passes_by_tenants: dict[int, int] = {}
        self.decode_slice_s = decode_slice_s
        self.decode_apart = decode_apart
        self._trained_out = False   # the training worker has stopped (decode_apart)
        self._last: Work | None = None

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

        Samples of the decode pool are not drained: each fails with `SchedulerClosed` at
        once, queued or decoding (`end_samples`), since they change no state and a
        sample is retried as easily as it is waited for. Without `drain` (or when the
        worker never started) every op not yet running fails with `SchedulerClosed`.
        Draining ends when no op is ready: ops still waiting for an earlier seq_id that
        never came then fail. If `timeout` seconds pass first, what is still waiting
        fails and the worker exits after its current batch.
        """
        with self._cond:
            self._closed = True
        self.end_samples(SchedulerClosed(
            "the server is shutting down; the sample was stopped (send it again once the "
            "server is back)"))
        with self._cond:
            threads = list(self._threads)
            failed = [] if drain and threads else self._take_all_waiting()
            self._cond.notify_all()
        fail_all(failed, SchedulerClosed("the server is shutting down; the op was not run"))
        if not threads:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in threads):
            with self._cond:
                failed = self._take_all_waiting()
            fail_all(failed, SchedulerClosed(
                f"the server stopped draining after {timeout} s; the op was not run"))

    def _take_all_waiting(self) -> list[Entry]:
        return self._lane.take_joining() + self._queues.take_waiting()

    # ------------------------------------------------------------------ queues

    def register_model(self, queue_id: str, next_seq: int = 0) -> None:
        """Create the queue `queue_id`, whose first ordered op is `next_seq`.

        Registering an id that exists does nothing (its queue and next seq are kept).
        """
        if next_seq < 0:
            raise InvalidArgument(f"next_seq: {next_seq} must be at least 0")
        with self._cond:
            self._queues.register(queue_id, next_seq)

    def unregister(self, queue_id: str, reason: Exception) -> None:
        """Forget a queue; its waiting ops and its samples in the decode pool fail with
        `reason` now (a running batch finishes)."""
        self.end_samples(reason, queue_id)
        with self._cond:
            failed = self._queues.unregister(queue_id)
        fail_all(failed, reason)

    def next_seq(self, queue_id: str) -> int:
        """The seq_id the queue runs next (what a reconnecting client should send).

        Raises:
            UnknownQueue: no such queue.
        """
        with self._cond:
            return self._queues.next_seq(queue_id)

    def submit(self, op: Op) -> Future:
        """Queue `op`; returns at once with a future of the executor's result.

        A seq_id that is queued, running or finished (and still cached) returns that op's
        future. Refusals come back as failed futures: `SchedulerClosed`, `UnknownQueue`,
        `OutOfOrder`, and `ResourceExhausted` past `limits` (the op took nothing: send
        it again).
        """
        with self._cond:
            fut = OpFuture()
            fut.op = op
            if self._closed:
                error = SchedulerClosed("the server is shutting down; not accepting ops")
            else:
                limits = self.limits
                error = self._queues.admit(op, fut, lambda new: None if limits is None
                                           else limits.refusal(new, self._waiting_ops()))
            if isinstance(error, OpFuture):
                return error
            if error is None:
                self._cond.notify_all()   # both workers, with decode_apart
                return fut
        fut.set_exception(error)
        return fut

    def _waiting_ops(self) -> Iterator[Op]:
        """Every op queued or in the decode lane (not one running a batch)."""
        for queue in self._queues:
            yield from (entry.op for entry in queue.waiting())
        yield from (entry.op for _, _, entry in self._lane.entries())

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
            if self._cancel_plan(place, entry) == "keep":
                return False
            entry.waiters -= 1
            if entry.waiters > 0:
                return False
            in_pool = self._end(place, queue, entry) == "stop"
        if not in_pool:
            entry.future.set_exception(cancelled(entry.op))
        return True

    def end_samples(self, error: Exception, queue_id: str | None = None) -> int:
        """Answer every sample op of the decode pool with `error` now, those of queue
        `queue_id` or (None) of every queue, wherever each is: queued (an ordered one
        still takes its seq_id in its turn), joining, or in the pool, whose next slice
        drops its rows. What a closed session or a shutdown does: nobody is left to
        read those samples, and their rows hold the pool. Returns how many it ended."""
        with self._cond:
            found = [(place, queue, entry) for place, queue, entry in
                     (*self._lane.entries(), *self._queues.queued())
                     if queue_id in (None, entry.op.queue_id)
                     and self._cancel_plan(place, entry) != "keep"]
            for place, queue, entry in found:
                self._end(place, queue, entry)
        fail_all([entry for _, _, entry in found], error)
        return len(found)

    def _cancel_plan(self, place: Place, entry: Entry) -> str:
        """What ending `entry` at `place` does (`planning.plan_cancel`); "keep" also for
        one already ended."""
        if entry.cancelled:
            return "keep"
        return plan_cancel(self._lane.takes(entry.op), place, entry.op.seq_id is not None)

    def _end(self, place: Place, queue: Queue, entry: Entry) -> str:
        """End `entry` as `_cancel_plan` says (with the lock; its future is the caller's
        to answer); returns the plan."""
        action = self._cancel_plan(place, entry)
        entry.cancelled = True
        if action == "stop":
            self._lane.stop(entry)
            return action
        if place == "joining":
            self._lane.joining.remove((queue, entry))
            self._queues.retire(queue, entry)
        elif action == "drop":
            queue.unordered.remove(entry)
        # `skip`: it stays queued, and the lane's `divert` takes its seq_id in its turn.
        self._cond.notify_all()
        return action

    def _locate(self, future: Future) -> tuple[Place, Queue, Entry] | None:
        """Where the op of `future` is (call with the lock); None: not here."""
        return self._lane.locate(future) or self._queues.locate(future)

    def stats(self) -> dict[str, Any]:
        """Counters for logs and benchmarks.

        `depths` maps each queue to its ops not yet running; `merged_ops` counts ops that
        ran in batches of two or more; `passes_by_tenants` the passes of a merge group
        (forwards; samples with the static sampler) by how many tenants' ops each carried;
        `decoding` the sample ops in or joining the decode pool; `waits` per op kind, how
        many started and their seconds queued, summed.
        """
        with self._cond:
            depths = self._queues.depths()
            return {
                "mode": self.mode,
                "queues": len(depths),
                "depths": depths,
                "queued": sum(depths.values()),
                "running": self._queues.running(),
                "ops_run": self._ops_run,
                "batches_run": self._batches_run,
                "merged_ops": self._merged_ops,
                "passes_by_tenants": dict(self._passes_by_tenants),
                "decoding": len(self._lane),
                "decode_slices": self._lane.slices_run,
                "waits": {kind: (int(n), total)
                          for kind, (n, total) in self._queues.waits.items()},
            }

    # ------------------------------------------------------------------ worker

    def _take(self, only: Work | None = None
              ) -> tuple[Work, list[tuple[Queue, Entry]], list[int]] | None:
        """Wait for work and claim it: a training batch, or the decode ops joining the
        next slice and the pool's ops to stop in it; None once closed and drained.
        `only`: this worker's one kind of work (`decode_apart`)."""
        stranded: list[Entry] = []
        lane = self._lane
        with self._cond:
            while True:
                if lane.divert(self._queues):
                    self._cond.notify_all()   # the decode worker may be waiting
                heads, start = self._queues.ready_heads()
                decoding, joining = bool(lane.decoding), bool(lane.joining)
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
                    first_sample = lane.first_ticket()
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
                return work, *lane.hand_over()
            if only == "decode":   # the training worker strands what is left
                return None
            # Closed with nothing ready (this worker runs nothing now): what is left
            # waits on a seq_id that never came.
            stranded = self._queues.take_waiting()
            self._trained_out = True
            self._cond.notify_all()
        fail_all(stranded, SchedulerClosed("the server shut down before this op's earlier "
                                            "seq_ids arrived; it was not run"))
        return None

    def _claim(self, heads: list[Entry], start: int) -> list[tuple[Queue, Entry]]:
        """Mark the planned ops running (call with the lock)."""
        slots = self._slots() if self._slots is not None else None
        ops = plan_batch([e.op for e in heads], self.mode, self.token_budget, start, slots)
        by_op = {id(e.op): e for e in heads}
        return self._queues.run([by_op[id(op)] for op in ops])

    def _work(self, only: Work | None = None) -> None:
        while True:
            taken = self._take(only)
            if taken is None:
                return
            work, chosen, stopping = taken
            if work == "train":
                self._finish(chosen, batch_results(self.executor, [entry.op for _, entry in chosen]))
            else:
                self._finish(*self._run_decode(chosen, stopping), batch=False)
            self._last = work

    def _run_decode(self, joining: list[tuple[Queue, Entry]], stopping: list[int]
                    ) -> tuple[list[tuple[Queue, Entry]], list[Any]]:
        """One decode slice: the entries it finished and their results. A slice that
        raises fails every op in the pool (its state is then unknown); a key the
        scheduler does not hold (answered already) is passed over."""
        try:
            done = list(self.executor.decode([(e.ticket, e.op) for _, e in joining],
                                             self.decode_slice_s, stopping))
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else wrapped(exc)
            with self._cond:
                finished = self._lane.failed(error)
        else:
            with self._cond:
                finished, partial = self._lane.finished(done)
            for entry, word in partial:
                tell(entry, word)
        return [pair for pair, _ in finished], [result for _, result in finished]

    def _finish(self, chosen: list[tuple[Queue, Entry]], results: list[Any],
                batch: bool = True) -> None:
        """Answer `chosen` with `results`; `batch` False: they finished in a decode slice."""
        with self._cond:
            self._ops_run += len(chosen)
            if batch:
                self._batches_run += 1
                if len(chosen) > 1:
                    self._merged_ops += len(chosen)
                tenants = len({entry.op.tenant for _, entry in chosen})
                for _, entry in chosen:
                    entry.future.tenants = tenants
                if chosen[0][1].op.merge_group is not None:
                    self._passes_by_tenants[tenants] = (
                        self._passes_by_tenants.get(tenants, 0) + 1)
            for queue, entry in chosen:
                self._queues.retire(queue, entry)
            self._cond.notify_all()
        answer([entry for _, entry in chosen], results)
