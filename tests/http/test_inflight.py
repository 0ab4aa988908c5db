"""Inflight sampling clients through the stock SDK over HTTP:
`save_weights_and_get_sampling_client(kind="inflight")` publishes the model's weights to
its one mutable target, which every inflight client of the model samples; a later
inflight save updates it for the clients made before it too, while a snapshot client
keeps the weights of its moment. An unknown `kind` is refused naming it, and its seq_id
is consumed. The same contract over gRPC is tests/tinker_compat/test_inflight.py."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from tinker import types

from ..numerics import assert_alike_until_a_near_tie, topk_greedy_could_draw
from .test_seq_ids import next_op_runs

pytestmark = pytest.mark.integration

PROMPT = [5, 6, 7, 8]
TAUGHT = [101, 102, 103, 104]
"""The continuation the training steps teach after PROMPT: greedy sampling moves off its
untrained output (towards this; STEPS steps need not reach it)."""
GREEDY = types.SamplingParams(max_tokens=len(TAUGHT), temperature=0.0, seed=0, stop=[])
STEPS = 4
ADAM = types.AdamParams(learning_rate=5e-2)
"""High, so that STEPS steps visibly change the greedy output of the tiny model."""


def teaching_data() -> list[types.Datum]:
    """PROMPT followed by TAUGHT, next-token targets weighted on TAUGHT only."""
    ids = PROMPT + TAUGHT
    weights = np.array([0.0] * (len(PROMPT) - 1) + [1.0] * len(TAUGHT), np.float32)
    return [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(ids[1:], np.int64),
                                        "weights": weights})]


def train(training_client, steps: int = STEPS) -> None:
    for _ in range(steps):
        training_client.forward_backward(teaching_data(), "cross_entropy")
        training_client.optim_step(ADAM)
    # Every step done before any sampler is asked: samplers are not ordered after them.
    training_client.forward(teaching_data(), "cross_entropy").result()


def greedy(sampling_client) -> types.SampledSequence:
    """The greedy completion of PROMPT, with its top 2 at each step (`assert_same_output`)."""
    out = sampling_client.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY,
                                 topk_sample_logprobs=2).result()
    return out.sequences[0]


def assert_same_output(got, want) -> None:
    """Greedy tokens equal up to a near tie (the top two of `want` within NEAR_TIE),
    logprobs within LOGPROB_ATOL up to there: the same weights, but a checkpoint read
    back and an inflight copy route through other adapter slots, a decode batch may hold
    other rows, and a session's second sample reuses its first's prompt KV, so the
    logits are a rounding apart (tests/numerics.py)."""
    assert_alike_until_a_near_tie(want, got, topk_greedy_could_draw(want))


@pytest.fixture
def training_client(service):
    return service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()


@pytest.fixture(scope="module")
def http(server, base_url):
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]},
                      timeout=60) as client:
        yield client


def test_two_inflight_clients_of_one_model_sample_the_same_weights(training_client):
    train(training_client, 1)
    first = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    second = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = training_client.save_weights_and_get_sampling_client().result()
    assert first._sampling_session_id != second._sampling_session_id
    assert_same_output(greedy(first), greedy(second))
    assert_same_output(greedy(first), greedy(snapshot))


def test_a_later_inflight_save_moves_earlier_inflight_clients_but_not_snapshots(
        training_client):
    early = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    before = training_client.save_weights_and_get_sampling_client().result()
    old = greedy(before)
    assert_same_output(greedy(early), old)

    train(training_client)
    # Trained but not yet published: the inflight target still holds the old weights.
    assert_same_output(greedy(early), old)
    late = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    fresh = training_client.save_weights_and_get_sampling_client().result()
    new = greedy(fresh)
    assert new.tokens != old.tokens, "the training steps did not change the greedy output"
    assert_same_output(greedy(early), new)
    assert_same_output(greedy(late), new)
    assert_same_output(greedy(before), old)


def test_the_stock_sdk_refuses_an_unknown_kind_itself(service, http):
    """Why the next case posts by hand: tinker 0.38 validates `kind` (a Literal) when it
    builds the request, after numbering it, so nothing reaches the server (and that
    training client's later ops wait for the seq_id it never sent; it is not reused)."""
    doomed = service.create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(ValueError, match="kind"):
        doomed.save_weights_and_get_sampling_client(kind="bogus").result(timeout=60)
    http.post("/api/v1/unload_model", json={"model_id": doomed.model_id})


def test_an_unknown_kind_is_refused_with_400_naming_kind_and_takes_its_seq_id(
        training_client, http):
    model = training_client.model_id
    next_op_runs(http, model, 1)
    answer = http.post("/api/v1/save_weights_for_sampler", json={
        "model_id": model, "seq_id": 2, "sampling_session_seq_id": 0, "kind": "bogus"})
    assert answer.status_code == 400, answer.text
    assert "kind" in answer.json()["detail"] and "bogus" in answer.json()["detail"]
    next_op_runs(http, model, 3)
