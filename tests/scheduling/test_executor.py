"""The executor between the scheduler and the engine's decode pool, with a scripted fake
engine (no torch): keys of cancelled ops reach the engine, and keys it no longer knows
(their ops failed with a slice that raised) never fail another op."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from twinkle_server.engine.errors import Cancelled
from twinkle_server.scheduling.executor import SAMPLE, EngineExecutor
from twinkle_server.scheduling.scheduler import Op, Scheduler

WAIT_SECONDS = 5

Script = Callable[[list, list, list], list]


class FakeEngine:
    """`Engine.decode` played from `script(requests, keys, cancelled)` per call (`then`
    once the script is over), every call recorded; a script entry that is an exception is
    raised."""

    def __init__(self, *script: Script | BaseException,
                 then: Script = lambda r, k, c: []) -> None:
        self.script = list(script)
        self.then = then
        self.calls: list[tuple[list, list, list]] = []

    def decode(self, requests, keys, slice_s, cancelled=()):
        self.calls.append((list(requests), list(keys), list(cancelled)))
        step = self.script.pop(0) if self.script else self.then
        if isinstance(step, BaseException):
            raise step
        return step(list(requests), list(keys), list(cancelled))


def sample(name: str) -> Op:
    return Op("samp", None, "sample", SAMPLE, 4, name)


def test_the_keys_of_cancelled_ops_reach_the_engine_and_come_back_as_their_ops():
    engine = FakeEngine(lambda r, k, c: [],
                        lambda r, k, c: [(key, Cancelled("gone")) for key in c])
    executor = EngineExecutor(engine)   # type: ignore[arg-type]
    kept, gone = sample("kept"), sample("gone")
    assert executor.decode([kept, gone], 0.1) == []
    (op, result), = executor.decode([], 0.1, cancelled=[gone])
    assert op is gone and isinstance(result, Cancelled)
    assert engine.calls[1][2] == [engine.calls[0][1][1]]   # gone's key, and only it


def test_a_cancelled_op_already_answered_sends_no_key():
    engine = FakeEngine(lambda r, k, c: [(k[0], "done")])
    executor = EngineExecutor(engine)   # type: ignore[arg-type]
    op = sample("quick")
    assert executor.decode([op], 0.1) == [(op, "done")]
    assert executor.decode([], 0.1, cancelled=[op]) == []
    assert engine.calls[1][2] == []


def test_after_a_raising_slice_the_executor_forgets_its_keys_and_late_answers_fail_no_op():
    first_keys: list[int] = []

    def late(requests, keys, cancelled):
        # The engine still answers the ops the raising slice failed, and the new one.
        return [(key, "late") for key in first_keys] + [(keys[0], "fresh")]

    engine = FakeEngine(lambda r, k, c: first_keys.extend(k) or [],
                        RuntimeError("device lost"), late)
    executor = EngineExecutor(engine)   # type: ignore[arg-type]
    assert executor.decode([sample("a"), sample("b")], 0.1) == []
    with pytest.raises(RuntimeError, match="device lost"):
        executor.decode([], 0.1)
    new = sample("new")
    assert executor.decode([new], 0.1) == [(new, "fresh")]
    # The next slice asked the engine to drop what it may still hold of the failed ops.
    assert sorted(engine.calls[2][2]) == sorted(first_keys)


def test_a_slice_that_raises_fails_its_pool_and_the_next_sample_still_succeeds():
    """Issue 30, fault 3: the engine answering a key of a failed op once raised KeyError
    in the executor and failed every innocent request of that slice."""
    failed_keys: list[int] = []

    def remember(requests, keys, cancelled):
        failed_keys.extend(keys)
        return []

    def late(requests, keys, cancelled):
        return [(key, "late") for key in failed_keys] + [(key, "ok") for key in keys]

    engine = FakeEngine(remember, RuntimeError("device lost"), late)
    sched = Scheduler(EngineExecutor(engine), decode_group=SAMPLE)   # type: ignore[arg-type]
    sched.register_model("samp")
    try:
        doomed = sched.submit(sample("doomed"))
        sched.start()
        with pytest.raises(RuntimeError, match="device lost"):
            doomed.result(WAIT_SECONDS)
        assert sched.submit(sample("innocent")).result(WAIT_SECONDS) == "ok"
    finally:
        sched.stop(drain=False, timeout=WAIT_SECONDS)


def test_a_sample_cancelled_through_the_scheduler_leaves_the_engine_pool():
    holding: list[int] = []

    def hold(requests, keys, cancelled):
        holding.extend(keys)
        for key in cancelled:
            holding.remove(key)
        return [(key, Cancelled("left the pool")) for key in cancelled]

    engine = FakeEngine(then=hold)
    sched = Scheduler(EngineExecutor(engine), decode_group=SAMPLE,   # type: ignore[arg-type]
                      decode_slice_s=0.01)
    sched.register_model("samp")
    try:
        sched.start()
        future = sched.submit(sample("long"))
        deadline = time.monotonic() + WAIT_SECONDS
        while not holding:
            assert time.monotonic() < deadline, "the sample never reached the engine"
            time.sleep(0.001)
        assert sched.cancel(future) is True
        with pytest.raises(Cancelled, match="stopped waiting"):
            future.result(WAIT_SECONDS)
        assert holding == [] and sched.stats()["decoding"] == 0
    finally:
        sched.stop(drain=False, timeout=WAIT_SECONDS)


def test_turns_go_first_come_first_served_and_a_releaser_queues_behind_a_waiter():
    """Two workers on a shared device: the one that releases and asks again goes behind
    the one already waiting, so neither starves the other."""
    import threading

    from twinkle_server.scheduling.executor import Turns

    turns = Turns()
    order: list[str] = []
    waiting = threading.Event()

    def other() -> None:
        waiting.set()
        with turns:
            order.append("other")

    with turns:
        order.append("first")
        thread = threading.Thread(target=other)
        thread.start()
        assert waiting.wait(WAIT_SECONDS)
        deadline = time.monotonic() + WAIT_SECONDS
        while not turns._waiting and time.monotonic() < deadline:   # other is queued
            time.sleep(0.001)
    with turns:
        order.append("again")
    thread.join(WAIT_SECONDS)
    assert order == ["first", "other", "again"]


def test_an_engine_decoding_elsewhere_takes_no_turn_for_its_slices():
    """A split model's decode slices run on its sampler ranks: they never wait for the
    device its training shares with another model, while its training batches do."""
    import threading

    from twinkle_server.scheduling.executor import Turns

    turns = Turns()
    executor = EngineExecutor(FakeEngine(), turns, decodes_here=False)
    with turns:   # another model holds the shared device
        finished = threading.Event()
        thread = threading.Thread(target=lambda: (executor.decode([], 0.1),
                                                  finished.set()))
        thread.start()
        assert finished.wait(WAIT_SECONDS)
        thread.join(WAIT_SECONDS)
