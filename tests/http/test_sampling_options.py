"""Tinker's sampling options through the stock SDK over HTTP: `target_prompt_logprobs`
(as `tinker_cookbook.recipes.decisions` sends it), `topk_sample_logprobs`,
`prompt_alt_tokens_k`, `prompt_logprobs_last_n` (in `sample` and `compute_logprobs`), and
their limits.

The `check_*` functions take any Tinker `SamplingClient`; `tests/tinker_compat` runs the
same checks through `tinker_compat` over gRPC. Every value is compared with one the
server computes another way: `compute_logprobs` of a prompt with the token in question
written in, or the top-k of the same prefill. They agree to float32 rounding
(`LOGPROB_ATOL`); the engine tests compare with a plain forward of the model.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from ..numerics import LOGPROB_ATOL, assert_alike_until_a_near_tie, topk_greedy_could_draw
from .conftest import sft_data

pytestmark = pytest.mark.integration
TOKENS = [5, 6, 7, 8, 9, 10, 11, 12]
PROMPT = types.ModelInput.from_ints(TOKENS)
ONE_TOKEN = types.SamplingParams(max_tokens=1, seed=0)


def _logprob_at(sampler, tokens: list[int], position: int, token: int) -> float:
    """log p(token at `position` | tokens[:position]), by `compute_logprobs`."""
    written = tokens[:position] + [token]
    return sampler.compute_logprobs(types.ModelInput.from_ints(written)).result()[position]


def check_sparse_targets_like_the_decisions_recipe(sampler) -> None:
    """`decision.sample_decision`: one row of labels at the answer position, sent sparse;
    read back with `.to_torch()[choice_pos - 1]`."""
    choice_pos, labels = 6, [40, 41, 42, 43]
    target_ids = torch.full((len(TOKENS) - 1, len(labels)), -1, dtype=torch.int64)
    target_ids[choice_pos - 1] = torch.tensor(labels, dtype=torch.int64)
    sent = types.TensorData.from_torch_sparse(target_ids, pad_value=-1)
    assert sent.sparse_crow_indices is not None   # the layout the recipe really sends
    response = sampler.sample(prompt=PROMPT, num_samples=1, sampling_params=ONE_TOKEN,
                              target_prompt_logprobs=sent).result()
    got = response.target_prompt_logprobs
    assert got is not None and got.dtype == "float32"
    assert got.sparse_crow_indices == sent.sparse_crow_indices
    assert got.sparse_col_indices == sent.sparse_col_indices
    dense = got.to_torch()
    assert list(dense.shape) == [len(TOKENS) - 1, len(labels)]
    expected = [_logprob_at(sampler, TOKENS, choice_pos, label) for label in labels]
    np.testing.assert_allclose(dense[choice_pos - 1].numpy(), expected, atol=LOGPROB_ATOL)
    assert (dense[torch.arange(len(TOKENS) - 1) != choice_pos - 1] == 0).all()
    assert response.prompt_logprobs is None   # not asked for


def check_dense_targets_with_gaps(sampler) -> None:
    ids = np.full((len(TOKENS) - 1, 2), -1, np.int64)
    ids[2] = [TOKENS[3], 99]           # the real next token, and another
    ids[5, 1] = 17
    response = sampler.sample(PROMPT, 1, ONE_TOKEN, include_prompt_logprobs=True,
                              target_prompt_logprobs=types.TensorData.from_numpy(ids)).result()
    got = response.target_prompt_logprobs.to_numpy()
    assert response.target_prompt_logprobs.sparse_crow_indices is None
    assert got.shape == ids.shape and (got[ids == -1] == 0.0).all()
    np.testing.assert_allclose(got[2, 0], response.prompt_logprobs[3], atol=LOGPROB_ATOL)
    np.testing.assert_allclose(got[2, 1], _logprob_at(sampler, TOKENS, 3, 99),
                               atol=LOGPROB_ATOL)
    np.testing.assert_allclose(got[5, 1], _logprob_at(sampler, TOKENS, 6, 17),
                               atol=LOGPROB_ATOL)


def check_topk_sample_logprobs(sampler) -> None:
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    seq = sampler.sample(PROMPT, 1, greedy, topk_sample_logprobs=3).result().sequences[0]
    assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens) == 4
    for token, logprob, top in zip(seq.tokens, seq.logprobs, seq.topk_logprobs, strict=True):
        assert len(top) == 3
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][0] == token   # greedy: the sampled token is the likeliest
        np.testing.assert_allclose(top[0][1], logprob, atol=LOGPROB_ATOL)
    # The runner-up at the first sampled position, scored by compute_logprobs.
    runner_up, lp = seq.topk_logprobs[0][1]
    np.testing.assert_allclose(lp, _logprob_at(sampler, TOKENS, len(TOKENS), runner_up),
                               atol=LOGPROB_ATOL)
    plain = sampler.sample(PROMPT, 1, greedy).result().sequences[0]
    assert plain.topk_logprobs is None
    # Its prompt's KV is the first sample's (one session), computed in another shape:
    # greedy tokens up to a near tie of seq's top two (tests/numerics.py).
    assert_alike_until_a_near_tie(seq, plain, topk_greedy_could_draw(seq))


def check_prompt_alt_tokens(sampler) -> None:
    greedy = types.SamplingParams(max_tokens=1, temperature=0.0)
    response = sampler.sample(PROMPT, 1, greedy, topk_prompt_logprobs=1,
                              prompt_alt_tokens_k=2).result()
    alt = response.prompt_alt_tokens
    tokens, logprobs = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert tokens.shape == logprobs.shape == (len(TOKENS) - 1, 2)
    assert alt.tokens.dtype == "int64" and alt.logprobs.dtype == "float32"
    # Exact: the alt draws and the top-k come from the same scoring pass's logits.
    for row in range(len(TOKENS) - 1):   # temperature 0: the argmax, twice
        best_id, best_lp = response.topk_prompt_logprobs[row + 1][0]
        assert tokens[row].tolist() == [best_id, best_id]
        np.testing.assert_allclose(logprobs[row], [best_lp] * 2, atol=LOGPROB_ATOL)
    warm = types.SamplingParams(max_tokens=1, temperature=1.0, seed=5)
    a = sampler.sample(PROMPT, 1, warm, prompt_alt_tokens_k=4).result().prompt_alt_tokens
    b = sampler.sample(PROMPT, 1, warm, prompt_alt_tokens_k=4).result().prompt_alt_tokens
    # Exact: each its own scoring pass of the same prompt (no prefix cache), same shapes.
    np.testing.assert_array_equal(a.tokens.to_numpy(), b.tokens.to_numpy())
    draw = int(a.tokens.to_numpy()[3, 0])
    np.testing.assert_allclose(a.logprobs.to_numpy()[3, 0],
                               _logprob_at(sampler, TOKENS, 4, draw), atol=LOGPROB_ATOL)


def check_prompt_logprobs_last_n(sampler) -> None:
    whole = sampler.sample(PROMPT, 1, ONE_TOKEN, include_prompt_logprobs=True,
                           topk_prompt_logprobs=2).result()
    last = sampler.sample(PROMPT, 1, ONE_TOKEN, include_prompt_logprobs=True,
                          topk_prompt_logprobs=2, prompt_logprobs_last_n=3).result()
    assert last.prompt_logprobs[:-3] == [None] * (len(TOKENS) - 3)
    np.testing.assert_allclose(last.prompt_logprobs[-3:], whole.prompt_logprobs[-3:],
                               atol=LOGPROB_ATOL)
    assert last.topk_prompt_logprobs[:-3] == [None] * (len(TOKENS) - 3)
    assert [[t for t, _ in row] for row in last.topk_prompt_logprobs[-3:]] == \
        [[t for t, _ in row] for row in whole.topk_prompt_logprobs[-3:]]
    scored = sampler.compute_logprobs(PROMPT, prompt_logprobs_last_n=2).result()
    assert scored[:-2] == [None] * (len(TOKENS) - 2)
    np.testing.assert_allclose(scored[-2:], whole.prompt_logprobs[-2:], atol=LOGPROB_ATOL)


LIMITS = [
    ({"include_prompt_logprobs": True, "prompt_logprobs_last_n": 8},
     r"prompt_logprobs_last_n: must be between 1 and len\(prompt\) - 1 = 7, got 8"),
    ({"topk_sample_logprobs": 21}, r"topk_sample_logprobs: must be in \[0, 20\], got 21"),
    ({"prompt_alt_tokens_k": 21}, r"prompt_alt_tokens_k: must be in \[0, 20\], got 21"),
    ({"target_prompt_logprobs": types.TensorData.from_numpy(np.full((3, 1), 5, np.int64))},
     r"target_prompt_logprobs: must have shape \[len\(prompt\) - 1, K\] = \[7, K\]"),
    ({"target_prompt_logprobs": types.TensorData.from_numpy(
        np.arange(7 * 10, dtype=np.int64).reshape(7, 10))},
     "target_prompt_logprobs: 70 distinct token ids; at most 64"),
    ({"target_prompt_logprobs": types.TensorData.from_numpy(np.full((7, 1), 10**6, np.int64))},
     r"target_prompt_logprobs: token id 1000000 is outside \[0, "),
]


def check_limits(sampler, options, message) -> None:
    with pytest.raises(tinker.BadRequestError, match=message):
        sampler.sample(PROMPT, 1, ONE_TOKEN, **options).result()


# ----------------------------------------------------------------------------- HTTP runs


@pytest.fixture(scope="module")
def sampler(service):
    tc = service.create_lora_training_client(base_model="tiny", rank=8, seed=4).result()
    tc.forward_backward(sft_data(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return tc.save_weights_and_get_sampling_client().result()


@pytest.mark.parametrize("check", [
    check_sparse_targets_like_the_decisions_recipe, check_dense_targets_with_gaps,
    check_topk_sample_logprobs, check_prompt_alt_tokens, check_prompt_logprobs_last_n,
], ids=lambda f: f.__name__[len("check_"):])
def test_sampling_option(sampler, check):
    check(sampler)


@pytest.mark.parametrize(("options", "message"), LIMITS)
def test_sampling_option_limits(sampler, options, message):
    check_limits(sampler, options, message)
