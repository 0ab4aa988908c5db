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
    params = {"max_tokens": 16, **params}  # the engine refuses max_tokens 0 (the default)
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
    ignored = _sample(model, _req([4, 4], max_tokens=6, temperature=0.0, ignore_eos=True),
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


# ---------------------------------------------------------------- Tinker's sampling options
# Every value is checked against an independent computation: log_softmax of a plain
# forward of the model's logits (`_reference_logp`), within LOGPROB_ATOL (float32: the two
# sides run GEMMs of different shapes; see tests/numerics.py).


def _reference_logp(model, tokens):
    """`[T, V]` float32: row t is log p(. | tokens[:t + 1]), from one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(np.asarray(tokens, np.int64))[None]).logits
    return torch.log_softmax(logits[0].float(), -1)


PROMPT = np.array([1, 5, 9, 2, 6, 7, 3], np.int64)


def test_target_prompt_logprobs_gather_the_named_ids_and_zero_elsewhere(model):
    from twinkle_server.engine.prompt_scoring import PromptScoring, score_prompt

    targets = np.full((PROMPT.size - 1, 3), -1, np.int64)
    targets[3] = [11, 12, 299]             # row 3 scores prompt position 4
    targets[5, 1] = 42
    out = score_prompt(model, _route, None, PROMPT, PromptScoring(targets=targets))
    logp = _reference_logp(model, PROMPT)
    assert out.target_logprobs.shape == (6, 3) and out.target_logprobs.dtype == np.float32
    np.testing.assert_allclose(out.target_logprobs[3], logp[3, [11, 12, 299]].numpy(),
                               atol=LOGPROB_ATOL)
    np.testing.assert_allclose(out.target_logprobs[5, 1], float(logp[5, 42]), atol=LOGPROB_ATOL)
    mask = targets == -1
    assert (out.target_logprobs[mask] == 0.0).all()
    # Own logprobs were not asked for: none are returned scored.
    assert np.isnan(out.logprobs).all() and out.topk_token_ids is None


def test_prompt_logprobs_last_n_scores_only_the_suffix_with_its_top_k(model):
    from twinkle_server.engine.prompt_scoring import PromptScoring, score_prompt

    whole = prompt_logprobs(model, _route, None, PROMPT, topk=2)
    out = score_prompt(model, _route, None, PROMPT, PromptScoring(include=True, topk=2,
                                                                  last_n=2))
    assert np.isnan(out.logprobs[:-2]).all()
    np.testing.assert_allclose(out.logprobs[-2:], whole.logprobs[-2:], atol=LOGPROB_ATOL)
    assert (out.topk_token_ids[:-2] == 0).all()
    assert (out.topk_logprobs[:-2] == TOPK_MASK_LOGPROB).all()
    np.testing.assert_array_equal(out.topk_token_ids[-2:], whole.topk_token_ids[-2:])
    logp = _reference_logp(model, PROMPT)
    np.testing.assert_allclose(out.logprobs[-1], float(logp[-2, PROMPT[-1]]), atol=LOGPROB_ATOL)


def test_prompt_alt_tokens_are_argmax_at_temperature_0_with_their_logprobs(model):
    from twinkle_server.engine.prompt_scoring import PromptScoring, score_prompt

    out = score_prompt(model, _route, None, PROMPT, PromptScoring(alt_k=3, temperature=0.0))
    logp = _reference_logp(model, PROMPT)[:-1]
    assert out.alt_tokens.shape == out.alt_logprobs.shape == (6, 3)
    assert out.alt_tokens.dtype == np.int64 and out.alt_logprobs.dtype == np.float32
    best = logp.argmax(-1).numpy()
    np.testing.assert_array_equal(out.alt_tokens, np.repeat(best[:, None], 3, axis=1))
    np.testing.assert_allclose(out.alt_logprobs, logp.gather(-1, torch.from_numpy(
        out.alt_tokens)).numpy(), atol=LOGPROB_ATOL)


def test_prompt_alt_tokens_follow_the_tempered_distribution_and_the_seed(model):
    from twinkle_server.engine.prompt_scoring import PromptScoring, score_prompt

    temperature = 0.02  # sharp enough that the two likeliest tokens take most draws
    def draws(seed):
        return score_prompt(model, _route, None, PROMPT, PromptScoring(
            alt_k=20, temperature=temperature, seed=seed))
    first = draws(7)
    np.testing.assert_array_equal(first.alt_tokens, draws(7).alt_tokens)
    logp = _reference_logp(model, PROMPT)[:-1]
    # Each draw carries its untempered logprob, whatever the temperature.
    np.testing.assert_allclose(first.alt_logprobs, logp.gather(-1, torch.from_numpy(
        first.alt_tokens)).numpy(), atol=LOGPROB_ATOL)
    tokens = np.concatenate([draws(seed).alt_tokens for seed in range(40)], axis=1)  # 800
    probs = torch.softmax(logp / temperature, -1).numpy()
    for row in range(tokens.shape[0]):
        top = int(probs[row].argmax())
        p, n = float(probs[row, top]), tokens.shape[1]
        seen = float((tokens[row] == top).mean())
        # Binomial(800, p): 5 standard deviations, so a correct sampler fails ~1e-6 of runs.
        assert abs(seen - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9, (row, seen, p)


def test_topk_sample_logprobs_are_the_teacher_forced_top_k_of_each_sampled_position(model):
    asked = GenerationRequest(None, PROMPT, 2, SamplingParams(max_tokens=5, seed=3), 4)
    plain = _req([4, 4], max_tokens=3, seed=1)
    with_topk, without = _sample(model, asked, plain, eos=())
    assert without[0].topk_token_ids is None and without[0].topk_logprobs is None
    for seq in with_topk:
        assert seq.topk_token_ids.shape == seq.topk_logprobs.shape == (seq.tokens.size, 4)
        assert seq.topk_token_ids.dtype == np.int32 and seq.topk_logprobs.dtype == np.float32
        full = np.concatenate([PROMPT, seq.tokens.astype(np.int64)])
        logp = _reference_logp(model, full)[PROMPT.size - 1:-1]   # the sampled positions
        values, ids = torch.topk(logp, 4, dim=-1)
        np.testing.assert_array_equal(seq.topk_token_ids, ids.numpy())
        np.testing.assert_allclose(seq.topk_logprobs, values.numpy(), atol=LOGPROB_ATOL)


@pytest.mark.parametrize(("options", "message"), [
    ({"include": True, "last_n": 7}, r"prompt_logprobs_last_n: must be between 1 and "
                                     r"len\(prompt\) - 1 = 6, got 7"),
    ({"include": True, "last_n": 0}, "prompt_logprobs_last_n: must be between 1"),
    ({"last_n": 2}, "prompt_logprobs_last_n: applies to prompt logprobs"),
    ({"alt_k": 21}, r"prompt_alt_tokens_k: must be in \[0, 20\], got 21"),
    ({"targets": np.full((5, 1), 3)}, r"target_prompt_logprobs: must have shape "
                                      r"\[len\(prompt\) - 1, K\] = \[6, K\], got \[5, 1\]"),
    ({"targets": np.full((6, 2), -1)}, "target_prompt_logprobs: names no token id"),
    ({"targets": np.full((6, 1), 300)}, r"token id 300 is outside \[0, 300\)"),
    ({"targets": np.full((6, 1), -2)}, r"token id -2 is outside"),
    ({"targets": np.arange(6 * 11).reshape(6, 11)},
     "target_prompt_logprobs: 66 distinct token ids; at most 64"),
])
def test_bad_prompt_scoring_options_name_the_field_and_limit(model, options, message):
    from twinkle_server.engine.prompt_scoring import PromptScoring, check

    with pytest.raises(InvalidArgument, match=message):
        check(PromptScoring(**options), PROMPT.size, 300)


def test_topk_sample_logprobs_over_the_cap_is_refused_before_sampling(model):
    with pytest.raises(InvalidArgument, match=r"topk_sample_logprobs: must be in \[0, 20\]"):
        _sample(model, GenerationRequest(None, PROMPT, 1, SamplingParams(max_tokens=2), 21))
