"""The static batch: seeds, stopping rules, greedy decoding and top-k sample logprobs."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from twinkle_server.engine.sampling.static import generate
from twinkle_server.engine.types import SampleRequest, SamplingParams

from ...numerics import assert_alike_until_a_near_tie, assert_topk_alike, greedy_could_draw
from ..draws import assert_sampled_alike, sampled_alone
from ..small import decode as _decode
from ..small import route as _route
from ..test_prompt_scoring import PROMPT, reference_logp


def _sample(model, *requests, eos=(299,)):
    out = generate(model, _route, list(requests), [None] * len(requests), eos_token_ids=eos,
                   pad_token_id=0, decode=_decode)
    assert not any(isinstance(r, Exception) for r in out), out
    return out


def _req(prompt, n=1, topk=0, **params):
    params = {"max_tokens": 16, **params}  # the engine refuses max_tokens 0 (the default)
    return SampleRequest(None, None, np.asarray(prompt, np.int64), n, SamplingParams(**params),
                         topk)


def test_same_seed_gives_the_same_tokens_alone_or_batched(model):
    target = _req([5, 6, 7, 8], 2, max_tokens=12, seed=42)
    alone = sampled_alone(lambda: _sample(model, target)[0], target.params)
    batched = _sample(model, _req([1, 2], 1, max_tokens=5, seed=1), target,
                      _req(list(range(10, 20)), 3, max_tokens=7, seed=2))[1]
    # The request's own generator draws the same numbers; its logits are a rounding apart
    # (left-padded to 10 among 6 rows, against 4 among 2), which changes a token only at
    # a draw within rounding of a boundary: tokens up to such a near tie, logprobs to
    # LOGPROB_ATOL (`draws.assert_sampled_alike`).
    assert_sampled_alike(alone, batched)
    first = alone.sequences
    assert not np.array_equal(first[0].tokens, first[1].tokens)
    other = _sample(model, _req([5, 6, 7, 8], 1, max_tokens=12, seed=43))[0][0]
    assert not np.array_equal(other.tokens, first[0].tokens)


def test_greedy_equals_an_uncached_argmax_loop_and_top_k_one(model):
    prompt = [3, 1, 4, 1, 5]
    greedy = _sample(model, _req(prompt, max_tokens=8, temperature=0.0))[0][0]
    ids, logprobs, tops = list(prompt), [], []
    with torch.no_grad():
        for _ in range(8):
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
            ids.append(int(logp.argmax()))
            logprobs.append(float(logp[ids[-1]]))
            tops.append(torch.topk(logp, 2))
    loop = SimpleNamespace(tokens=ids[len(prompt):], logprobs=logprobs, stop_reason="length")
    # Cached against uncached logits, a rounding apart: the argmax is the same unless the
    # top two are within NEAR_TIE of each other.
    assert_alike_until_a_near_tie(loop, greedy, greedy_could_draw(
        [t.indices.tolist() for t in tops], [t.values.tolist() for t in tops]))
    # Exact: the same batch (one row, this prompt) and code, so the same logits; top-k 1
    # is greedy, and top_p 1e-6 keeps only the likeliest token.
    top1 = _sample(model, _req(prompt, max_tokens=8, top_k=1, seed=9))[0][0]
    tiny_p = _sample(model, _req(prompt, max_tokens=8, top_p=1e-6, seed=9))[0][0]
    assert top1.tokens.tolist() == tiny_p.tokens.tolist() == greedy.tokens.tolist()


def test_stop_token_is_included_and_reported_as_stop(model):
    # Exact here and below: the free and the stopped run are the same batch and code up
    # to the stop, so the same logits and tokens.
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
    assert stopped.stop_text_at == _decode(stopped.tokens).index(stop)


def test_max_tokens_gives_length_and_eos_stops_unless_disabled(model):
    free = _sample(model, _req([4, 4], max_tokens=6, temperature=0.0), eos=())[0][0]
    assert free.stop_reason == "length" and free.tokens.size == 6
    eos = int(free.tokens[1])
    assert _sample(model, _req([4, 4], max_tokens=6, temperature=0.0), eos=(eos,))[0][0] \
        .stop_reason == "stop"
    ignored = _sample(model, _req([4, 4], max_tokens=6, temperature=0.0, ignore_eos=True),
                      eos=(eos,))[0][0]
    assert ignored.stop_reason == "length" and ignored.tokens.size == 6


def test_topk_sample_logprobs_are_the_teacher_forced_top_k_of_each_sampled_position(model):
    asked = _req(PROMPT, 2, topk=4, max_tokens=5, seed=3)
    plain = _req([4, 4], max_tokens=3, seed=1)
    with_topk, without = _sample(model, asked, plain, eos=())
    assert without[0].topk_token_ids is None and without[0].topk_logprobs is None
    for seq in with_topk:
        assert seq.topk_token_ids.shape == seq.topk_logprobs.shape == (seq.tokens.size, 4)
        assert seq.topk_token_ids.dtype == np.int32 and seq.topk_logprobs.dtype == np.float32
        full = np.concatenate([PROMPT, seq.tokens.astype(np.int64)])
        logp = reference_logp(model, full)[PROMPT.size - 1:-1]   # the sampled positions
        # KV-cached against one plain forward, a rounding apart: the same top 4 up to
        # tokens whose logprobs are within rounding (`numerics.assert_topk_alike`).
        assert_topk_alike(seq.topk_token_ids, seq.topk_logprobs, logp.numpy())
