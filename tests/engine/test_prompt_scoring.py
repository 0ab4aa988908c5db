"""Prompt scoring: own logprobs, top-k, target ids, last-n and alternative draws, each
against an independent computation (a plain forward's log_softmax, `reference_logp`),
within LOGPROB_ATOL (float32: the two sides run GEMMs of different shapes; see
tests/numerics.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.prompt_scoring import (
    TOPK_MASK_LOGPROB,
    PromptScoring,
    check,
    score_prompt,
)

from ..numerics import LOGPROB_ATOL, assert_argmax_alike, assert_topk_alike
from .small import route as _route


def prompt_logprobs(model, route, adapter_id, tokens, topk=0):
    return score_prompt(model, route, adapter_id, tokens, PromptScoring(include=True, topk=topk))


def reference_logp(model, tokens):
    """`[T, V]` float32: row t is log p(. | tokens[:t + 1]), from one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(np.asarray(tokens, np.int64))[None]).logits
    return torch.log_softmax(logits[0].float(), -1)


PROMPT = np.array([1, 5, 9, 2, 6, 7, 3], np.int64)


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
    # The scoring pass's chunks against one plain forward: a rounding apart, so the top 3
    # up to tokens whose logprobs are within rounding (`numerics.assert_topk_alike`).
    assert_topk_alike(out.topk_token_ids[1:], out.topk_logprobs[1:], logp[:4].numpy())
    np.testing.assert_allclose(out.logprobs, prompt_logprobs(model, _route, None, tokens).logprobs)
    with pytest.raises(InvalidArgument, match=r"topk_prompt_logprobs: must be in \[0, 20\]"):
        prompt_logprobs(model, _route, None, tokens, topk=21)


def test_target_prompt_logprobs_gather_the_named_ids_and_zero_elsewhere(model):
    targets = np.full((PROMPT.size - 1, 3), -1, np.int64)
    targets[3] = [11, 12, 299]             # row 3 scores prompt position 4
    targets[5, 1] = 42
    out = score_prompt(model, _route, None, PROMPT, PromptScoring(targets=targets))
    logp = reference_logp(model, PROMPT)
    assert out.target_logprobs.shape == (6, 3) and out.target_logprobs.dtype == np.float32
    np.testing.assert_allclose(out.target_logprobs[3], logp[3, [11, 12, 299]].numpy(),
                               atol=LOGPROB_ATOL)
    np.testing.assert_allclose(out.target_logprobs[5, 1], float(logp[5, 42]), atol=LOGPROB_ATOL)
    mask = targets == -1
    assert (out.target_logprobs[mask] == 0.0).all()
    # Own logprobs were not asked for: none are returned scored.
    assert np.isnan(out.logprobs).all() and out.topk_token_ids is None


def test_prompt_logprobs_last_n_scores_only_the_suffix_with_its_top_k(model):
    whole = prompt_logprobs(model, _route, None, PROMPT, topk=2)
    out = score_prompt(model, _route, None, PROMPT, PromptScoring(include=True, topk=2,
                                                                  last_n=2))
    assert np.isnan(out.logprobs[:-2]).all()
    np.testing.assert_allclose(out.logprobs[-2:], whole.logprobs[-2:], atol=LOGPROB_ATOL)
    assert (out.topk_token_ids[:-2] == 0).all()
    assert (out.topk_logprobs[:-2] == TOPK_MASK_LOGPROB).all()
    assert_topk_alike(out.topk_token_ids[-2:], out.topk_logprobs[-2:],
                      reference_logp(model, PROMPT)[-3:-1].numpy())
    logp = reference_logp(model, PROMPT)
    np.testing.assert_allclose(out.logprobs[-1], float(logp[-2, PROMPT[-1]]), atol=LOGPROB_ATOL)


def test_prompt_alt_tokens_are_argmax_at_temperature_0_with_their_logprobs(model):
    out = score_prompt(model, _route, None, PROMPT, PromptScoring(alt_k=3, temperature=0.0))
    logp = reference_logp(model, PROMPT)[:-1]
    assert out.alt_tokens.shape == out.alt_logprobs.shape == (6, 3)
    assert out.alt_tokens.dtype == np.int64 and out.alt_logprobs.dtype == np.float32
    assert_argmax_alike(out.alt_tokens, logp.numpy())   # up to a near tie
    assert (out.alt_tokens == out.alt_tokens[:, :1]).all()     # one argmax, three times
    np.testing.assert_allclose(out.alt_logprobs, logp.gather(-1, torch.from_numpy(
        out.alt_tokens)).numpy(), atol=LOGPROB_ATOL)


@pytest.mark.parametrize("temperature", [1e-30, 1e-300])
def test_prompt_alt_tokens_at_a_vanishing_temperature_are_the_argmax(model, temperature):
    """The limit of a vanishing temperature; 1e-300 (0 in float32) once divided the
    logprobs by zero and the draw failed on NaN."""
    out = score_prompt(model, _route, None, PROMPT, PromptScoring(
        alt_k=3, temperature=temperature, seed=1))
    assert_argmax_alike(out.alt_tokens, reference_logp(model, PROMPT)[:-1].numpy())
    assert (out.alt_tokens == out.alt_tokens[:, :1]).all()


def test_prompt_alt_tokens_follow_the_tempered_distribution_and_the_seed(model):
    temperature = 0.02  # sharp enough that the two likeliest tokens take most draws
    def draws(seed):
        return score_prompt(model, _route, None, PROMPT, PromptScoring(
            alt_k=20, temperature=temperature, seed=seed))
    first = draws(7)
    # Exact: the same request twice, the same shapes and code.
    np.testing.assert_array_equal(first.alt_tokens, draws(7).alt_tokens)
    logp = reference_logp(model, PROMPT)[:-1]
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
    with pytest.raises(InvalidArgument, match=message):
        check(PromptScoring(**options), PROMPT.size, 300)
