"""Tinker's sampling options through `tinker_compat` over gRPC: the same checks the stock
SDK passes over HTTP (`tests/http/test_sampling_options.py`), on a trained adapter's
sampler, plus the options the client refuses before sending, as the SDK does."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from tinker_compat import ServiceClient

from ..http.test_sampling_options import (
    LIMITS,
    ONE_TOKEN,
    PROMPT,
    check_dense_targets_with_gaps,
    check_limits,
    check_prompt_alt_tokens,
    check_prompt_logprobs_last_n,
    check_sparse_targets_like_the_decisions_recipe,
    check_topk_sample_logprobs,
)
from .conftest import sft_data

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sampler(server):
    client = ServiceClient(base_url=f"http://{server.address}")
    tc = client.create_lora_training_client(base_model="tiny", rank=8, seed=4).result()
    tc.forward_backward(sft_data(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    yield tc.save_weights_and_get_sampling_client().result()
    client.close()


@pytest.mark.parametrize("check", [
    check_sparse_targets_like_the_decisions_recipe, check_dense_targets_with_gaps,
    check_topk_sample_logprobs, check_prompt_alt_tokens, check_prompt_logprobs_last_n,
], ids=lambda f: f.__name__[len("check_"):])
def test_sampling_option(sampler, check):
    check(sampler)


@pytest.mark.parametrize(("options", "message"), LIMITS)
def test_sampling_option_limits(sampler, options, message):
    check_limits(sampler, options, message)


@pytest.mark.parametrize(("options", "message"), [
    ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n applies to prompt logprobs"),
    ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": 0},
     "prompt_logprobs_last_n: must be an int >= 1"),
    ({"prompt_alt_tokens_k": -1}, "prompt_alt_tokens_k: must be an int >= 0"),
    ({"target_prompt_logprobs": types.TensorData.from_numpy(np.ones((7, 1), np.float32))},
     "target_prompt_logprobs must be an int64 tensor"),
    ({"target_prompt_logprobs": types.TensorData.from_numpy(np.ones(7, np.int64))},
     "target_prompt_logprobs must be 2-D"),
])
def test_options_the_sdk_refuses_are_refused_before_sending(sampler, options, message):
    with pytest.raises(ValueError, match=message):
        sampler.sample(PROMPT, 1, ONE_TOKEN, **options)


def test_top_p_zero_is_refused_as_over_http_not_read_as_no_cut(sampler):
    """The wire once could not tell top_p 0 from top_p left out, so the gRPC server
    sampled it as 1.0, the whole distribution; HTTP refuses it by name."""
    with pytest.raises(tinker.BadRequestError, match=r"top_p: must be in \(0, 1\]"):
        sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=1, top_p=0.0)).result()


@pytest.mark.parametrize(("prompt", "num_samples", "max_tokens", "message"), [
    (PROMPT, 0, 1, r"num_samples: must be >= 1, got 0"),
    (PROMPT, 1, 0, r"sampling_params.max_tokens: must be >= 1, got 0"),
    (types.ModelInput.empty(), 1, 1, r"prompt: is empty"),
])
def test_values_the_server_refuses_fail_the_future_as_the_sdks_bad_request(
        sampler, prompt, num_samples, max_tokens, message):
    """The stock SDK sends these and its future fails with the server's 400
    (`BadRequestError`); tinker_compat raised a plain ValueError at the call."""
    future = sampler.sample(prompt, num_samples, types.SamplingParams(max_tokens=max_tokens))
    with pytest.raises(tinker.BadRequestError, match=message):
        future.result(timeout=60)
