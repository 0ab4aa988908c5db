"""The decode loop: seeds, stopping rules, greedy decoding and validation."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.sampler import (
    TOPK_MASK_LOGPROB,
    GenerationRequest,
    generate,
    prompt_logprobs,
)
from twinkle_server.engine.types import SamplingParams

from ..numerics import LOGPROB_ATOL


def _route(rows):
    return contextlib.nullcontext()


def _decode(ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         intermediate_size=128, max_position_embeddings=512)
    return Qwen3ForCausalLM(config).eval()


def _sample(model, *requests, eos=(299,)):
    return generate(model, _route, list(requests), eos_token_ids=eos, pad_token_id=0,
                    decode=_decode)


def _req(prompt, n=1, **params):
    return GenerationRequest(None, np.asarray(prompt, np.int64), n, SamplingParams(**params))


def test_same_seed_gives_the_same_tokens_alone_or_batched(model):
    target = _req([5, 6, 7, 8], 2, max_tokens=12, seed=42)
    alone = _sample(model, target)[0]
    batched = _sample(model, _req([1, 2], 1, max_tokens=5, seed=1), target,
                      _req(list(range(10, 20)), 3, max_tokens=7, seed=2))[1]
    for a, b in zip(alone, batched, strict=True):
        # The request's own generator draws the same numbers; its logits are a rounding
        # apart (left-padded to 10 among 6 rows, against 4 among 2), which changes a token
        # only if a draw lands within ~1e-6 of a boundary. Logprobs: LOGPROB_ATOL.
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=LOGPROB_ATOL)
    assert not np.array_equal(alone[0].tokens, alone[1].tokens)
    other = _sample(model, _req([5, 6, 7, 8], 1, max_tokens=12, seed=43))[0][0]
    assert not np.array_equal(other.tokens, alone[0].tokens)


def test_greedy_equals_an_uncached_argmax_loop_and_top_k_one(model):
    prompt = [3, 1, 4, 1, 5]
    greedy = _sample(model, _req(prompt, max_tokens=8, temperature=0.0))[0][0]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    # Cached against uncached logits, a rounding apart: the argmax is the same unless the
    # top two logits are within ~1e-6 of each other.
    assert greedy.tokens.tolist() == ids[len(prompt):]
    top1 = _sample(model, _req(prompt, max_tokens=8, top_k=1, seed=9))[0][0]
    tiny_p = _sample(model, _req(prompt, max_tokens=8, top_p=1e-6, seed=9))[0][0]
    assert top1.tokens.tolist() == tiny_p.tokens.tolist() == greedy.tokens.tolist()


def test_stop_token_is_included_and_reported_as_stop(model):
    free = _sample(model, _req([7, 7], max_tokens=10, temperature=0.0))[0][0]
    stop_id = int(free.tokens[3])
    first = free.tokens.tolist().index(stop_id)
    stopped = _sample(model, _req([7, 7], max_tokens=10, temperature=0.0,
                                  stop_token_ids=(stop_id,)))[0][0]
    assert stopped.stop_reason == "stop"
    assert stopped.tokens.tolist() == free.tokens[:first + 1].tolist()


def test_stop_string_ends_at_the_token_that_completes_it(model):
    free = _sample(model, _req([9, 2], max_tokens=10, temperature=0.0))[0][0]
    text = _decode(free.tokens)
    stop = text[4:6]
    stopped = _sample(model, _req([9, 2], max_tokens=10, temperature=0.0,
                                  stop_strings=(stop,)))[0][0]
    assert stopped.stop_reason == "stop"
    assert stop in _decode(stopped.tokens) and stop not in _decode(stopped.tokens[:-1])


def test_max_tokens_gives_length_and_eos_stops_unless_disabled(model):
    free = _sample(model, _req([4, 4], max_tokens=6, temperature=0.0), eos=())[0][0]
    assert free.stop_reason == "length" and free.tokens.size == 6
    eos = int(free.tokens[1])
    assert _sample(model, _req([4, 4], max_tokens=6, temperature=0.0), eos=(eos,))[0][0] \
        .stop_reason == "stop"
    ignored = _sample(model, _req([4, 4], max_tokens=6, temperature=0.0, stop_on_eos=False),
                      eos=(eos,))[0][0]
    assert ignored.stop_reason == "length" and ignored.tokens.size == 6


def test_prompt_logprobs_match_a_manual_gather_with_nan_first(model):
    tokens = np.array([1, 5, 9, 2, 6], np.int64)
    out = prompt_logprobs(model, _route, None, tokens).logprobs
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.from_numpy(tokens)[None]).logits[0], -1)
    assert np.isnan(out[0])
    np.testing.assert_allclose(out[1:], [float(logp[t, tokens[t + 1]]) for t in range(4)],
                               atol=1e-5)


def test_topk_prompt_logprobs_are_the_most_likely_tokens_in_order_with_row_0_masked(model):
    tokens = np.array([1, 5, 9, 2, 6], np.int64)
    out = prompt_logprobs(model, _route, None, tokens, topk=3)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.from_numpy(tokens)[None]).logits[0], -1)
    assert out.topk_token_ids.shape == out.topk_logprobs.shape == (5, 3)
    assert out.topk_token_ids.dtype == np.int32 and out.topk_logprobs.dtype == np.float32
    assert out.topk_token_ids[0].tolist() == [0, 0, 0]
    assert out.topk_logprobs[0].tolist() == [TOPK_MASK_LOGPROB] * 3
    for t in range(4):
        best = torch.argsort(logp[t], descending=True)[:3]
        assert out.topk_token_ids[t + 1].tolist() == best.tolist()
        np.testing.assert_allclose(out.topk_logprobs[t + 1], logp[t, best].numpy(), atol=1e-5)
    np.testing.assert_allclose(out.logprobs, prompt_logprobs(model, _route, None, tokens).logprobs)
    with pytest.raises(InvalidArgument, match=r"topk_prompt_logprobs: must be in \[0, 20\]"):
        prompt_logprobs(model, _route, None, tokens, topk=21)


@pytest.mark.parametrize(("request_", "message"), [
    (_req([1], 0), "num_samples: must be >= 1"),
    (_req([1], max_tokens=0), "max_tokens: must be >= 1"),
    (_req([1], temperature=-1.0), "temperature: must be finite and >= 0"),
    (_req([1], top_p=0.0), r"top_p: must be in \(0, 1\]"),
    (_req([]), "prompt: is empty"),
])
def test_bad_sampling_requests_name_the_field(model, request_, message):
    with pytest.raises(InvalidArgument, match=message):
        _sample(model, request_)
