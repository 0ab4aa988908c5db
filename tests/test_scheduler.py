"""Scheduler decisions and threading, with no model: a recording executor stands in for
the engine glue; the scheduler itself is the real thing."""

from __future__ import annotations

import threading
import time

import pytest

from twinkle_server.scheduler import (
    Op,
    OutOfOrder,
    Scheduler,
    SchedulerClosed,
    UnknownQueue,
    plan_batch,
)


class Recorder:
    def __init__(self, delay: float = 0.0, fail_kind: str | None = None):
        self.batches: list[list[tuple[str, int | None, str]]] = []
        self.delay = delay
        self.fail_kind = fail_kind
        self.gate = threading.Event()
        self.gate.set()

    def run_batch(self, ops):
        self.gate.wait(5)
        time.sleep(self.delay)
        self.batches.append([(o.queue_id, o.seq_id, o.kind) for o in ops])
        if self.fail_kind == "raise" and any(o.kind == "explode" for o in ops):
            raise RuntimeError("executor blew up")
        return [ValueError(f"bad {o.seq_id}") if o.kind == "bad" else (o.queue_id, o.seq_id)
                for o in ops]


def fwd(queue, seq, tokens=10, kind="forward_backward"):
    return Op(queue, seq, kind, "forward", tokens, None)


def optim(queue, seq):
    return Op(queue, seq, "optim_step", None, 0, None)


@pytest.fixture
def make():
    made = []

    def build(executor=None, **kw):
        sched = Scheduler(executor or Recorder(), **kw)
        made.append(sched)
        return sched
    yield build
    for sched in made:
        sched.stop(drain=False, timeout=5)


def test_ops_submitted_out_of_order_run_in_seq_order(make):
    rec = Recorder()
    sched = make(rec)
    sched.register_model("a")
    futures = [sched.submit(fwd("a", s)) for s in (3, 1, 2, 0)]
    sched.start()
    assert [f.result(5) for f in futures] == [("a", 3), ("a", 1), ("a", 2), ("a", 0)]
    assert [b[0][1] for b in rec.batches] == [0, 1, 2, 3]


def test_concurrent_submissions_from_eight_threads_still_run_in_order(make):
    rec = Recorder()
    sched = make(rec)
    for q in ("a", "b"):
        sched.register_model(q)
    sched.start()
    futures = []
    lock = threading.Lock()

    def client(q, seqs):
        for s in seqs:
            f = sched.submit(fwd(q, s))
            with lock:
                futures.append(f)

    threads = [threading.Thread(target=client, args=(q, range(i, 40, 4)))
               for q in ("a", "b") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in futures:
        f.result(10)
    for q in ("a", "b"):
        seen = [s for b in rec.batches for (qq, s, _) in b if qq == q]
        assert seen == list(range(40))


def test_retried_seq_returns_the_stored_result_and_runs_once(make):
    rec = Recorder()
    sched = make(rec)
    sched.register_model("a")
    sched.start()
    first = sched.submit(fwd("a", 0)).result(5)
    again = sched.submit(fwd("a", 0)).result(5)
    assert first == again == ("a", 0)
    assert sum(len(b) for b in rec.batches) == 1


def test_retry_while_pending_shares_the_future(make):
    sched = make()
    sched.register_model("a")
    one, two = sched.submit(fwd("a", 5)), sched.submit(fwd("a", 5))
    assert one is two


def test_forgotten_or_far_future_seq_fails_with_a_clear_message(make):
    sched = make(result_cache_size=1)
    sched.register_model("a")
    sched.start()
    for s in range(3):
        sched.submit(fwd("a", s)).result(5)
    with pytest.raises(OutOfOrder, match="seq_id: 0 already ran.*expects seq_id 3"):
        sched.submit(fwd("a", 0)).result(5)
    with pytest.raises(OutOfOrder, match="more than 1024 ahead"):
        sched.submit(fwd("a", 5000)).result(5)
    with pytest.raises(UnknownQueue, match="no model or sampling session 'zz'"):
        sched.submit(fwd("zz", 0)).result(5)


def test_merged_mode_merges_forwards_of_different_models_within_budget(make):
    rec = Recorder()
    sched = make(rec, token_budget=25)
    for q in "abcd":
        sched.register_model(q)
    futures = [sched.submit(fwd(q, 0)) for q in "abcd"]
    futures += [sched.submit(fwd("a", 1)), sched.submit(optim("b", 1))]
    sched.start()
    for f in futures:
        f.result(5)
    assert rec.batches[0] == [("a", 0, "forward_backward"), ("b", 0, "forward_backward")]
    for batch in rec.batches:
        assert len({q for q, _, _ in batch}) == len(batch)
        assert sum(10 for _ in batch) <= 25
        if any(kind == "optim_step" for _, _, kind in batch):
            assert len(batch) == 1


def test_optim_step_waits_for_its_model_while_other_models_proceed(make):
    rec = Recorder()
    sched = make(rec)
    sched.register_model("a")
    sched.register_model("b")
    opt = sched.submit(optim("a", 1))
    b_done = sched.submit(fwd("b", 0))
    sched.start()
    assert b_done.result(5) == ("b", 0)
    assert not opt.done()
    sched.submit(fwd("a", 0))
    assert opt.result(5) == ("a", 1)


def test_timeshare_batches_hold_one_model_and_rotate_fairly(make):
    rec = Recorder()
    sched = make(rec, mode="timeshare")
    sched.register_model("flood")
    sched.register_model("small")
    futures = [sched.submit(fwd("flood", s)) for s in range(10)]
    futures.append(sched.submit(fwd("small", 0)))
    sched.start()
    for f in futures:
        f.result(5)
    assert all(len(b) == 1 for b in rec.batches)
    position = [b[0][0] for b in rec.batches].index("small")
    assert position <= 1


def test_plan_batch_decisions():
    heads = [fwd("a", 0, 10), fwd("b", 0, 10), optim("c", 0), fwd("d", 0, 30),
             Op("e", 0, "sample", "sample", 5, None)]
    assert plan_batch(heads, "merged", 25) == heads[:2]
    assert plan_batch(heads, "timeshare", 25) == heads[:1]
    assert plan_batch(heads[2:], "merged", 100) == [heads[2]]
    assert plan_batch([fwd("a", 0, 100)], "merged", 10) == [fwd("a", 0, 100)]
    assert plan_batch([], "merged", 10) == []


def test_a_failed_op_fails_only_itself_and_an_executor_crash_only_its_batch(make):
    rec = Recorder(fail_kind="raise")
    sched = make(rec, mode="timeshare")
    sched.register_model("a")
    bad = sched.submit(Op("a", 0, "bad", "forward", 1, None))
    boom = sched.submit(Op("a", 1, "explode", None, 1, None))
    good = sched.submit(fwd("a", 2))
    sched.start()
    with pytest.raises(ValueError, match="bad 0"):
        bad.result(5)
    with pytest.raises(RuntimeError, match="executor blew up"):
        boom.result(5)
    assert good.result(5) == ("a", 2)


def test_stop_with_drain_finishes_work_then_refuses(make):
    rec = Recorder(delay=0.01)
    sched = make(rec)
    sched.register_model("a")
    futures = [sched.submit(fwd("a", s)) for s in range(5)]
    sched.start()
    sched.stop(drain=True, timeout=5)
    assert [f.result(0) for f in futures] == [("a", s) for s in range(5)]
    with pytest.raises(SchedulerClosed):
        sched.submit(fwd("a", 5)).result(1)


def test_stop_without_drain_and_unregister_fail_pending_ops(make):
    sched = make()
    sched.register_model("a")
    sched.register_model("b")
    waiting_a = sched.submit(fwd("a", 1))
    waiting_b = sched.submit(fwd("b", 1))
    sched.unregister("a", LookupError("session expired"))
    with pytest.raises(LookupError, match="session expired"):
        waiting_a.result(1)
    assert not waiting_b.done()
    sched.start()
    sched.stop(drain=False, timeout=5)
    with pytest.raises(SchedulerClosed):
        waiting_b.result(1)


def test_drain_fails_ops_whose_earlier_seq_never_arrived(make):
    sched = make()
    sched.register_model("a")
    sched.start()
    orphan = sched.submit(fwd("a", 3))
    sched.stop(drain=True, timeout=5)
    with pytest.raises(SchedulerClosed, match="earlier seq_ids"):
        orphan.result(1)


def test_reusing_a_seq_for_a_different_kind_of_op_is_refused(make):
    sched = make()
    sched.register_model("a")
    sched.start()
    sched.submit(fwd("a", 0)).result(5)
    with pytest.raises(OutOfOrder, match="seq_id: 0 was already used by a forward_backward"):
        sched.submit(optim("a", 0)).result(5)
