"""Sampling through the stock SDK over HTTP: seeded, with logprobs, stop sequences,
prompt logprobs, and samplers from a saved checkpoint and from the current weights."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from ..numerics import assert_rows_alike, neighbours_could_draw, sdk_score
from .conftest import sft_data

pytestmark = pytest.mark.integration
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])


@pytest.fixture(scope="module")
def trained(service):
    tc = service.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
    tc.forward_backward(sft_data(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return tc


def test_seeded_sample_with_logprobs(trained):
    sampler = trained.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=6, seed=7, temperature=1.0)
    a = sampler.sample(PROMPT, 2, params).result()
    b = sampler.sample(PROMPT, 2, params).result()
    assert len(a.sequences) == 2
    # The same seed; b reuses a's prompt KV (one sampling session), computed in another
    # shape: the same tokens up to a near tie (tests/numerics.py).
    assert_rows_alike(a.sequences, b.sequences, lambda row: neighbours_could_draw(
        a.sequences[row].tokens, sdk_score(sampler, PROMPT.to_ints())))
    seq = a.sequences[0]
    assert len(seq.tokens) == len(seq.logprobs) == 6 and seq.stop_reason == "length"
    assert all(lp <= 0 for lp in seq.logprobs) and isinstance(seq.sequence_id, str)


def test_stop_sequences(trained):
    # Each sample the first of its own sampling session (of the same weights), alone: the
    # same shapes and code up to the stop, so the same tokens exactly.
    free = trained.save_weights_and_get_sampling_client().result().sample(
        PROMPT, 1, types.SamplingParams(max_tokens=8, seed=3)).result()
    stop_at = free.sequences[0].tokens[2]
    stopped = trained.save_weights_and_get_sampling_client().result().sample(
        PROMPT, 1, types.SamplingParams(max_tokens=8, seed=3, stop=[stop_at])
    ).result().sequences[0]
    assert stopped.stop_reason == "stop" and stopped.tokens[-1] == stop_at
    assert len(stopped.tokens) <= 3


def test_compute_logprobs_and_prompt_logprobs(service, trained):
    path = trained.save_weights_for_sampler("for-sampling").result().path
    assert "/sampler_weights/for-sampling" in path
    sampler = service.create_sampling_client(model_path=path).result()
    logprobs = sampler.compute_logprobs(PROMPT).result()
    assert logprobs[0] is None and len(logprobs) == 4
    response = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=2, seed=1),
                              include_prompt_logprobs=True).result()
    np.testing.assert_allclose(response.prompt_logprobs[1:], logprobs[1:], rtol=1e-5)
    assert sampler.get_base_model() == "tiny"
    base = service.create_sampling_client(base_model="tiny").result()
    base_lp = base.compute_logprobs(PROMPT).result()
    assert base_lp[1:] != logprobs[1:]   # the trained adapter changed them
