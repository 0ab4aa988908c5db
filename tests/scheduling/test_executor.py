"""The scheduler and executor before the engine's decode pool, with a scripted fake engine
(no torch): a sample's one key reaches the engine and comes back, keys of cancelled ops
reach the engine, and keys it no longer knows (their ops failed with a slice that
raised) never fail another op."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from twinkle_server.engine.errors import Cancelled
from twinkle_server.engine.types import Progress, SampledSequence
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


def scheduled(engine: FakeEngine, **kw) -> Scheduler:
    sched = Scheduler(EngineExecutor(engine), decode_group=SAMPLE,   # type: ignore[arg-type]
                      decode_slice_s=0.01, **kw)
    sched.register_model("samp")
    return sched


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_a_sample_has_one_key_from_its_queue_to_the_engine_pool_and_back():
    """The scheduler's arrival ticket is the key the engine's pool answers under: no
    registry between them renames it."""
    answered: list[int] = []

    def answer_next(requests, keys, cancelled):
        answered.extend(keys)
        return [(key, f"answer {key}") for key in keys]

    sched = scheduled(FakeEngine(then=answer_next))
    try:
        sched.start()
        first = sched.submit(sample("first"))
        assert first.result(WAIT_SECONDS) == f"answer {answered[0]}"
        second = sched.submit(sample("second"))
        assert second.result(WAIT_SECONDS) == f"answer {answered[1]}"
        assert answered[1] > answered[0]
    finally:
        sched.stop(drain=False, timeout=WAIT_SECONDS)


def test_the_key_of_a_sample_cancelled_in_the_pool_reaches_the_engine_and_only_it():
    held: list[int] = []

    def hold(requests, keys, cancelled):
        held.extend(keys)
        return [(key, Cancelled("left the pool")) for key in cancelled]

    engine = FakeEngine(then=hold)
    sched = scheduled(engine)
    try:
        sched.start()
        kept, gone = sched.submit(sample("kept")), sched.submit(sample("gone"))
        until(lambda: len(held) == 2, "the samples never reached the engine")
        assert sched.cancel(gone) is True
        with pytest.raises(Cancelled):
            gone.result(WAIT_SECONDS)
        until(lambda: any(c for _, _, c in engine.calls), "the cancel never reached the engine")
        sent = [key for _, _, cancelled in engine.calls for key in cancelled]
        assert sent == [max(held)] and not kept.done()   # gone came second: the later ticket
    finally:
        sched.stop(drain=False, timeout=WAIT_SECONDS)


def test_a_slice_that_raises_fails_its_pool_and_the_next_sample_still_succeeds():
    """Issue 30, fault 3: the engine answering a key of a failed op once raised KeyError
    in the executor and failed every innocent request of that slice. The next slice also
    asks the engine to drop whatever it still holds of the failed ops."""
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
        assert engine.calls[2][2] == failed_keys
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


def test_a_samples_progress_reaches_its_listener_before_its_answer_and_a_bad_one_harms_none():
    """The engine's `Progress` for an op still decoding goes to `Op.on_partial` (from the
    worker thread) and the op decodes on; a listener that raises loses nothing."""
    joined: list[int] = []

    def step(requests, keys, cancelled):
        """Two slices of progress for every op in the pool, then their answers."""
        joined.extend(keys)
        if len(engine.calls) <= 2:
            return [(key, Progress([SampledSequence(np.array([len(engine.calls)]), np.zeros(1), None)])) for key in joined]
        return [(key, "answer") for key in joined]

    heard: list = []

    def broken(progress):
        raise RuntimeError("listener bug")

    engine = FakeEngine(then=step)
    sched = scheduled(engine)
    try:
        listened = sched.submit(replace(sample("heard"), on_partial=heard.append))
        ignored = sched.submit(replace(sample("broken"), on_partial=broken))
        sched.start()
        assert listened.result(WAIT_SECONDS) == "answer"
        assert ignored.result(WAIT_SECONDS) == "answer"
        assert [p.rows[0].tokens.tolist() for p in heard] == [[1], [2]]
    finally:
        sched.stop(drain=False, timeout=WAIT_SECONDS)
