"""Cancelling the future of a call: a queued call never runs (its reserved seq_ids are
released instead, so the model's later ops run), a started ordered op cannot be taken back
(cancel is False and its result arrives), an interruptible call (a sample) is cancelled
while it runs, and a `.then()` future answers for the call it follows."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator

import pytest
from peft import LoraConfig

from twinkle_client.connection import MAX_INFLIGHT_CALLS, Connection
from twinkle_client.model import MultiLoraTransformersModel

from .conftest import toy_features

WAIT_S = 120.0
"""Bound on every wait: a hang fails the test instead of stalling the suite."""


@pytest.fixture
def conn() -> Iterator[Connection]:
    """A connection that sends nothing: these calls are local functions on its pool."""
    connection = Connection("http://127.0.0.1:9", client_name="test", open_session=False)
    yield connection
    connection.close()


def fill_call_pool(connection: Connection) -> threading.Event:
    """Occupy every thread of the call pool until the returned event is set, so the calls
    submitted meanwhile wait, queued."""
    gate = threading.Event()
    for _ in range(MAX_INFLIGHT_CALLS):
        connection.submit(gate.wait, WAIT_S)
    return gate


def started_call(connection: Connection, **options: object
                 ) -> tuple[concurrent.futures.Future, threading.Event]:
    """A call running on the pool until the returned event is set; it returns "done"."""
    running, finish = threading.Event(), threading.Event()

    def call() -> str:
        running.set()
        finish.wait(WAIT_S)
        return "done"

    future = connection.submit(call, **options)
    assert running.wait(WAIT_S)
    return future, finish


def test_a_cancelled_queued_call_never_runs_and_its_on_cancel_runs_instead(conn):
    gate = fill_call_pool(conn)
    ran, released = threading.Event(), threading.Event()
    future = conn.submit(ran.set, on_cancel=released.set)
    assert future.future().cancel()
    done, _ = concurrent.futures.wait([future.future()], timeout=WAIT_S)
    assert done == {future.future()}   # at once, not when its turn on the pool comes
    assert future.future().cancelled()
    gate.set()
    assert released.wait(WAIT_S)
    assert conn.submit(lambda: "next").result(timeout=WAIT_S) == "next"
    assert not ran.is_set()


def test_a_started_call_cannot_be_cancelled_and_its_result_arrives(conn, caplog):
    future, finish = started_call(conn)
    then = future.then(str.upper)
    assert not future.future().cancel()
    assert not then.future().cancel()
    assert future.future().running()
    finish.set()
    assert then.result(timeout=WAIT_S) == "DONE"
    assert not then.future().cancelled()
    assert not [r for r in caplog.records if r.name == "concurrent.futures"]


def test_cancelling_a_then_future_of_a_queued_call_cancels_the_call(conn):
    gate = fill_call_pool(conn)
    ran, released = threading.Event(), threading.Event()
    then = conn.submit(ran.set, on_cancel=released.set).then(lambda _: "never")
    assert then.future().cancel()
    assert then.future().cancelled()
    gate.set()
    assert released.wait(WAIT_S)
    assert not ran.is_set()
    with pytest.raises(concurrent.futures.CancelledError):
        then.result(timeout=WAIT_S)


def test_an_interruptible_call_is_cancelled_while_it_runs_and_its_result_dropped(conn, caplog):
    future, finish = started_call(conn, interruptible=True)
    assert future.future().running()
    assert future.future().cancel()
    assert future.future().cancelled() and not future.future().running()
    finish.set()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(timeout=WAIT_S)
    assert conn.submit(lambda: "next").result(timeout=WAIT_S) == "next"
    assert not [r for r in caplog.records if r.name == "concurrent.futures"]


@pytest.mark.integration
def test_cancelling_a_queued_op_releases_its_seq_id_so_later_ops_of_the_model_run(client):
    model = MultiLoraTransformersModel("ms://tiny")
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8,
                                                     target_modules="all-linear"), seed=0)
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=1e-2)
    batch = toy_features(2)
    gate = fill_call_pool(model.connection)
    trained = model.forward_backward(batch, blocking=False)
    norm = model.clip_grad_norm(1.0, blocking=False)   # a .then() future
    step = model.step(blocking=False)
    assert norm.future().cancel() and step.future().cancel()
    later = model.forward_only(batch, blocking=False)
    gate.set()
    assert later.result(timeout=WAIT_S).loss == pytest.approx(
        trained.result(timeout=WAIT_S).loss, rel=1e-5)   # no step ran in between
    assert norm.future().cancelled() and step.future().cancelled()
    assert not trained.future().cancel()
    assert model.get_train_configs()["step"] == 0
