"""Every request that carries a seq_id consumes it, whatever happens to it (issue 23, 2).

The SDK numbers every op of a training client (`seq_id`, from 1) and the server runs a
model's ops in that order; a number never consumed would leave every later op of the
model waiting for it, and the SDK polls `try_again` for ever. For each SDK route that
carries a seq_id, served or not, one request is refused at once, fails in its op, or is
not served, and then the model's next op must still run within `NEXT_OP_TIMEOUT_S`, so a
regression fails here instead of hanging. Requests are written by hand, with the SDK's
own bodies, to choose each seq_id.

SDK routes with a seq_id (tinker 0.38: `grep seq_id types/*request*.py`):
forward_backward (and forward: the same route, `forward_only`), optim_step, save_weights,
save_weights_for_sampler (named, or ephemeral with `sampling_session_seq_id`),
load_weights (with `model_id`), save_weights_external, and asample (a sampling session's
own numbering, which this server does not order by). Routes that carry another counter
(`model_seq_id`, `custom_loss_seq_id`, `sampling_session_seq_id`) name no model op.
"""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from twinkle_server.http import unserved

from .conftest import sft_data

pytestmark = pytest.mark.integration
NEXT_OP_TIMEOUT_S = 60.0
"""The next op of a tiny model answers in well under a second; a seq_id hole never."""


@pytest.fixture(scope="module")
def http(server, base_url):
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]},
                      timeout=60) as client:
        yield client


@pytest.fixture
def model(service, http):
    """A fresh model per case (its first op is seq_id 1), unloaded after."""
    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    yield tc.model_id
    http.post("/api/v1/unload_model", json={"model_id": tc.model_id})


def _forward_body(model_id: str, seq_id: int, data: list[types.Datum] | None = None,
                  loss: str = "cross_entropy", forward_only: bool = True) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=sft_data(n=1) if data is None else data, loss_fn=loss),
        model_id=model_id, seq_id=seq_id)
    message = forward_backward_request_to_proto(request)
    message.forward_only = forward_only
    return message.SerializeToString()


def _bad_datum() -> types.Datum:
    """3 input tokens, 2 targets: refused before it queues, naming the field."""
    return types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                       loss_fn_inputs={"target_tokens": np.array([1, 2], np.int64),
                                       "weights": np.ones(2, np.float32)})


def resolve(http: httpx.Client, answer: httpx.Response, timeout: float = NEXT_OP_TIMEOUT_S
            ) -> dict:
    """The result of the op a 200 answer promised, polled until it resolves; fails the
    test (instead of hanging) if it is still waiting after `timeout` seconds."""
    assert answer.status_code == 200, answer.text
    request_id = answer.json()["request_id"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id},
                      timeout=timeout + 30)
        if r.headers.get("content-type", "").startswith("application/json"):
            body = r.json()
            if body.get("type") == "try_again":
                continue
            return body
        return {"bytes": r.content}
    pytest.fail(f"op {request_id} still waiting after {timeout} s: a seq_id hole")


def next_op_runs(http: httpx.Client, model_id: str, seq_id: int) -> None:
    """The model's op `seq_id` (a forward) runs: every seq_id before it was consumed."""
    out = resolve(http, http.post("/api/v1/forward_backward",
                                  content=_forward_body(model_id, seq_id)))
    # The forward's output (protobuf, or JSON), not a failure.
    assert "error" not in out and (out.get("bytes") or out.get("loss_fn_outputs")), out


def _json(path: str, body: dict) -> dict:
    return {"method": "POST", "url": "/api/v1" + path, "json": body}


# Each case: the request under test at seq_id `s` of model `m`, and what it answers:
# an HTTP status (refused at once / not served), or "fails" (accepted, the op fails). A
# refused forward_backward fails in its future: the SDK sends a parallel call's first
# chunk only once the others are answered.
ROUTE_CASES = {
    "forward_backward refused (bad datum)": (
        lambda m, s: {"method": "POST", "url": "/api/v1/forward_backward",
                      "content": _forward_body(m, s, [_bad_datum()], forward_only=False)},
        "fails"),
    "forward_backward refused (unknown loss)": (
        lambda m, s: {"method": "POST", "url": "/api/v1/forward_backward",
                      "content": _forward_body(m, s, loss="no_such_loss",
                                               forward_only=False)},
        "fails"),
    "forward refused (bad datum)": (
        lambda m, s: {"method": "POST", "url": "/api/v1/forward_backward",
                      "content": _forward_body(m, s, [_bad_datum()])},
        "fails"),
    "optim_step refused (optimizer type)": (
        lambda m, s: _json("/optim_step", {"model_id": m, "seq_id": s,
                                           "optim_params": {"type": "sgd"}}),
        400),
    "save_weights refused (name)": (
        lambda m, s: _json("/save_weights", {"model_id": m, "seq_id": s, "path": "../up"}),
        400),
    "save_weights refused (ttl)": (
        lambda m, s: _json("/save_weights", {"model_id": m, "seq_id": s, "path": "a",
                                             "ttl_seconds": 5}),
        400),
    "save_weights_for_sampler refused (name)": (
        lambda m, s: _json("/save_weights_for_sampler",
                           {"model_id": m, "seq_id": s, "path": "a/b"}),
        400),
    "save_weights_for_sampler refused (no name, no sampling_session_seq_id)": (
        lambda m, s: _json("/save_weights_for_sampler", {"model_id": m, "seq_id": s}),
        400),
    "load_weights refused (path)": (
        lambda m, s: _json("/load_weights", {"model_id": m, "seq_id": s,
                                             "path": "tinker://nowhere", "optimizer": False}),
        400),
    "load_weights fails (no such checkpoint)": (
        lambda m, s: _json("/load_weights", {"model_id": m, "seq_id": s, "optimizer": False,
                                             "path": "tinker://run-000000000000/weights/x"}),
        "fails"),
    "save_weights_external refused (recipient)": (
        lambda m, s: _json("/save_weights_external", {
            "model_id": m, "seq_id": s, "path": "x", "age_encryption_recipients": ["age1no"]}),
        400),
    "save_weights_external refused (name)": (
        lambda m, s: _json("/save_weights_external",
                           {"model_id": m, "seq_id": s, "path": "..", "ttl_seconds": 3600}),
        400),
    "save_weights_external refused (ttl)": (
        lambda m, s: _json("/save_weights_external",
                           {"model_id": m, "seq_id": s, "path": "x", "ttl_seconds": -1}),
        400),
    "route unknown to this server (a newer SDK's op)": (
        lambda m, s: _json("/some_future_op", {"model_id": m, "seq_id": s}),
        404),
    **{f"unserved {path}": (
        lambda m, s, path=path: _json(path, {"model_id": m, "seq_id": s}), 404)
       for method, path, *_ in unserved.UNSERVED if method == "POST"},
}


@pytest.mark.parametrize("case", list(ROUTE_CASES))
def test_a_request_that_is_refused_fails_or_is_unserved_still_takes_its_seq_id(
        http, model, case):
    build, expected = ROUTE_CASES[case]
    next_op_runs(http, model, 1)
    answer = http.request(**build(model, 2))
    if expected == "fails":
        out = resolve(http, answer)
        assert "error" in out, out
    else:
        assert answer.status_code == expected, answer.text
    next_op_runs(http, model, 3)


@pytest.mark.parametrize("route", ["/save_weights", "/save_weights_for_sampler",
                                   "/save_weights_external"])
def test_saving_over_an_existing_name_fails_in_its_op_and_takes_its_seq_id(http, model,
                                                                            route):
    first = resolve(http, http.post("/api/v1" + route, json={
        "model_id": model, "seq_id": 1, "path": "twice"}))
    assert "error" not in first, first
    again = resolve(http, http.post("/api/v1" + route, json={
        "model_id": model, "seq_id": 2, "path": "twice"}))
    assert "error" in again and "already exist" in again["error"], again
    next_op_runs(http, model, 3)


def test_a_refusal_that_arrives_before_its_predecessor_is_consumed_in_order(http, model):
    """The refused op of seq_id 2 is answered at once, before seq_id 1 arrives; seq_id 1
    then runs, and so does 3."""
    refused = http.post("/api/v1/optim_step", json={"model_id": model, "seq_id": 2,
                                                    "optim_params": {"type": "sgd"}})
    assert refused.status_code == 400, refused.text
    next_op_runs(http, model, 1)
    next_op_runs(http, model, 3)


def test_a_retried_refusal_answers_the_same_and_a_reused_seq_id_is_refused(http, model):
    body = {"model_id": model, "seq_id": 1, "optim_params": {"type": "sgd"}}
    first = http.post("/api/v1/optim_step", json=body)
    again = http.post("/api/v1/optim_step", json=body)
    assert first.status_code == again.status_code == 400
    assert again.json()["detail"] == first.json()["detail"]
    # seq_id 1 holds a refused optim_step: a save under it is another op, refused by name
    reused = http.post("/api/v1/save_weights", json={"model_id": model, "seq_id": 1,
                                                     "path": "../x"})
    assert reused.status_code == 412 and "already used" in reused.json()["detail"]
    next_op_runs(http, model, 2)


def _refusal(http: httpx.Client, answer: httpx.Response) -> str:
    """Why an op was refused: at once (a 4xx's detail) or in its future."""
    if answer.status_code == 200:
        return resolve(http, answer)["error"]
    return answer.json()["detail"]


def test_seq_id_refusals_count_as_the_sdk_does_from_1(http, model):
    """The runtime's queues count from 0; every message names the SDK's own numbers."""
    def optim_step(seq_id: int) -> str:
        return _refusal(http, http.post("/api/v1/optim_step", json={
            "model_id": model, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-3}}))

    assert optim_step(0) == "seq_id: 0 must be at least 1; the model expects seq_id 1 next"
    next_op_runs(http, model, 1)
    reused = _refusal(http, http.post("/api/v1/save_weights", json={
        "model_id": model, "seq_id": 1, "path": "x"}))
    assert reused.startswith("seq_id: 1 was already used by a forward"), reused
    assert reused.endswith("(the model expects 2)"), reused
    ahead = optim_step(10**6)
    assert ahead.startswith(f"seq_id: {10**6} is more than"), ahead
    assert ahead.endswith("ahead of the expected 2"), ahead


def test_a_refused_sample_leaves_the_sampler_serving(service, http):
    """asample carries the sampling client's own seq_id, which this server does not
    order by: a refused sample must not stop the next one either."""
    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    session = sampler._sampling_session_id
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}
    refused = http.post("/api/v1/asample", json={
        "sampling_session_id": session, "seq_id": 0, "num_samples": 1,
        "prompt": {"chunks": []}, "sampling_params": {"max_tokens": 1}})
    assert refused.status_code == 400, refused.text
    out = resolve(http, http.post("/api/v1/asample", json={
        "sampling_session_id": session, "seq_id": 1, "num_samples": 1, "prompt": prompt,
        "sampling_params": {"max_tokens": 2}}))
    assert "error" not in out, out
    http.post("/api/v1/unload_model", json={"model_id": tc.model_id})


def test_the_sdk_keeps_training_after_an_unserved_or_refused_op(service):
    """The issue's report, through the SDK itself: after a refused op the training
    client's later ops run (with a bounded wait, so a hole fails instead of hanging)."""
    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(Exception, match="age_encryption_recipients"):
        tc.save_weights_external("x", age_encryption_recipients=["not-a-key"]).result(
            timeout=NEXT_OP_TIMEOUT_S)
    with pytest.raises(Exception, match="input_ids has 3 tokens"):
        tc.forward_backward([_bad_datum()], "cross_entropy").result(timeout=NEXT_OP_TIMEOUT_S)
    out = tc.forward_backward(sft_data(n=2), "cross_entropy").result(timeout=NEXT_OP_TIMEOUT_S)
    assert out.metrics["loss:sum"] > 0
    # The step after a window in which one forward_backward failed beside one that
    # trained is refused, naming it (it might have been the same call's other chunk,
    # scheduling/executor.py); the next window steps.
    with pytest.raises(tinker.RequestFailedError, match="input_ids has 3 tokens"):
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=NEXT_OP_TIMEOUT_S)
    tc.forward_backward(sft_data(n=2), "cross_entropy").result(timeout=NEXT_OP_TIMEOUT_S)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=NEXT_OP_TIMEOUT_S)
