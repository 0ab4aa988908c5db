"""Inflight sampling clients through the shim over gRPC:
`save_weights_and_get_sampling_client(kind="inflight")` publishes the model's weights to
its one mutable target, which every inflight client of the model samples; a later
inflight save updates it for the clients made before it too, while a snapshot client
keeps the weights of its moment. The same contract over HTTP with the stock SDK is
tests/http/test_inflight.py."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from ..numerics import assert_alike_until_a_near_tie, topk_greedy_could_draw

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
def training_client(service_client):
    return service_client.create_lora_training_client("tiny", rank=4, seed=3).result()


def test_two_inflight_clients_of_one_model_sample_the_same_weights(training_client):
    train(training_client, 1)
    first = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    second = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = training_client.save_weights_and_get_sampling_client().result()
    assert first.sampling_session_id != second.sampling_session_id
    assert first.model_path is None and second.model_path is None
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


def test_an_unknown_kind_is_refused_before_sending_naming_kind(training_client):
    with pytest.raises(ValueError, match=r"kind: must be 'snapshot' or 'inflight', got 'bogus'"):
        training_client.save_weights_and_get_sampling_client(kind="bogus")
    # Nothing was sent: the model's next op runs.
    assert training_client.forward(teaching_data(), "cross_entropy").result(timeout=60)
