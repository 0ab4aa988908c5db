"""The one token step: near-tied logits draw the same token, rows whose logits are not
finite are reported and not drawn from, the stop rule."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle_server.engine.errors import FailedPrecondition
from twinkle_server.engine.sampling import tokens
from twinkle_server.engine.types import SampleRequest, SamplingParams


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=1, top_p=0.9),
                                    SamplingParams(max_tokens=1, top_k=5),
                                    SamplingParams(max_tokens=1, top_k=5, top_p=0.8)])
def test_near_tied_logits_draw_the_same_token_whichever_rounds_higher(params):
    """Two logits 4e-7 apart (what another batch's rounding gives) swap places in a
    sorted draw; drawn by token id, every seed picks the same token either way."""
    base = torch.linspace(-3, 0, 50)
    a, b = base.clone(), base.clone()
    a[[10, 40]] = b[[10, 40]] = 0.5
    a[10] += 4e-7
    b[40] += 4e-7
    for seed in range(64):
        ga, gb = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert tokens.pick(a[None], params, ga).item() == tokens.pick(b[None], params, gb).item()


def test_top_k_and_top_p_draw_only_from_the_kept_tokens():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9, -1.0, 3.0]])
    for seed in range(200):
        top_k = tokens.pick(logits, SamplingParams(max_tokens=1, top_k=2),
                            torch.Generator().manual_seed(seed)).item()
        assert top_k in (1, 3)
        top_p = tokens.pick(logits, SamplingParams(max_tokens=1, top_p=0.4),
                            torch.Generator().manual_seed(seed)).item()
        assert top_p == 1       # token 1 alone holds 48% of the mass


def test_draws_follow_the_distribution_and_never_pick_a_token_of_probability_zero():
    """20,000 seeded draws of a 6-token distribution (two tokens at probability 0, one of
    them the first id, one the last): each frequency within 5 standard errors of its
    probability (sqrt(p(1-p)/n) <= 0.0036 here), the zero tokens never drawn."""
    probs = torch.tensor([0.0, 0.5, 0.2, 0.25, 0.05, 0.0])
    logits = torch.log(probs)[None]
    n = 20_000
    counts = torch.zeros(6)
    generator = torch.Generator().manual_seed(0)
    for token in tokens.pick(logits.expand(n, 6), SamplingParams(max_tokens=1), generator):
        counts[token] += 1
    assert counts[0] == 0 and counts[5] == 0
    standard_error = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 5 * standard_error + 1e-9).all(), counts / n


def test_requests_drawn_in_one_batch_draw_what_each_draws_alone():
    """Plain requests (no top-k or top-p) are drawn together, filtered and greedy ones
    each apart; every request's tokens equal its draw alone from the same seed, and its
    logprobs agree to float32 rounding (log-softmax of the same row: 1e-6). The tokens
    exactly: the same rows of the same logits, and each op of the draw (softmax, cumulative
    sum, search) works row by row."""
    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, top_k=4),
              SamplingParams(max_tokens=1, temperature=0.6),
              SamplingParams(max_tokens=1, temperature=0),
              SamplingParams(max_tokens=1, top_p=0.9), SamplingParams(max_tokens=1)]
    bounds = [0, 3, 4, 9, 11, 12, 16]
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(3)) * 2
    for seed in range(20):
        segments = [tokens.Segment(range(a, b), p,
                                   torch.Generator().manual_seed(seed * 10 + i))
                    for i, (a, b, p) in enumerate(zip(bounds[:-1], bounds[1:], params,
                                                      strict=True))]
        together = tokens.draw(logits, segments, 0)
        for i, segment in enumerate(segments):
            alone = tokens.draw(logits[segment.at(logits.device)], [tokens.Segment(
                range(len(segment.rows)), segment.params,
                torch.Generator().manual_seed(seed * 10 + i))], 0)
            assert [together.tokens[r] for r in segment.rows] == alone.tokens
            assert [together.logprobs[r] for r in segment.rows] == pytest.approx(
                alone.logprobs, abs=1e-6)


def test_a_requests_rows_anywhere_in_the_batch_draw_as_when_they_are_together():
    """The decode pool holds a request's samples wherever its batch put them: drawn in
    the request's own order, each sample gets the number it gets with the rows together
    (the same rows of the same logits: equal exactly)."""
    params = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, top_k=4),
              SamplingParams(max_tokens=1, temperature=0.7)]
    logits = torch.randn(9, 200, generator=torch.Generator().manual_seed(8)) * 2
    scattered = [[7, 0, 4], [2, 8, 5], [1, 6, 3]]     # each request's samples, in order
    for seed in range(10):
        apart = tokens.draw(logits, [tokens.Segment(rows, p, torch.Generator().manual_seed(
            seed * 10 + i)) for i, (rows, p) in enumerate(zip(scattered, params,
                                                              strict=True))], 0)
        together = tokens.draw(logits[[r for rows in scattered for r in rows]], [
            tokens.Segment(range(3 * i, 3 * i + 3), p, torch.Generator().manual_seed(
                seed * 10 + i)) for i, p in enumerate(params)], 0)
        assert [apart.tokens[r] for rows in scattered for r in rows] == together.tokens


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=1, temperature=1e-30),
    SamplingParams(max_tokens=1, temperature=2.5e-39),      # float32's subnormals
    SamplingParams(max_tokens=1, temperature=5e-324),       # 0 in float32
    SamplingParams(max_tokens=1, temperature=1e-39, top_k=5),
    SamplingParams(max_tokens=1, top_p=1e-300),             # 0 in float32
    SamplingParams(max_tokens=1, temperature=1e-39, top_p=0.5)])
def test_a_temperature_or_top_p_near_zero_draws_the_most_likely_token(params):
    """The limit of a vanishing temperature, or top_p, is the most likely token: a
    temperature that overflowed the scores to inf once drew token V (out of range), and a
    top_p that rounds to 0 masked every token."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5)) * 3
    for plain_beside in (False, True):
        segments = [tokens.Segment(range(3), params, torch.Generator().manual_seed(1))]
        if plain_beside:
            segments.append(tokens.Segment(range(3, 6), SamplingParams(max_tokens=1),
                                           torch.Generator().manual_seed(2)))
        rows = segments[-1].rows[-1] + 1
        drawn = tokens.draw(logits[:rows], segments, 0)
        assert drawn.tokens[:3] == logits[:3].argmax(-1).tolist()
        assert all(drawn.finite(i) and 0 <= drawn.tokens[i] < 300 for i in range(rows))


@pytest.mark.parametrize("temperature", [1e39, 1e300])
def test_a_temperature_past_float32s_largest_keeps_masked_tokens_masked(temperature):
    """inf in float32: -inf over it was NaN, and the draw picked token V."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    logits[:, 10:] = -math.inf                   # a model may mask tokens
    params = SamplingParams(max_tokens=1, temperature=temperature)
    drawn = tokens.draw(logits, [tokens.Segment(range(3), params,
                                                torch.Generator().manual_seed(4))], 0)
    assert all(drawn.finite(i) and 0 <= drawn.tokens[i] < 10 for i in range(3))


def test_rows_whose_logits_are_not_finite_are_reported_and_the_others_drawn():
    logits = torch.randn(4, 30)
    logits[1, 3] = math.nan
    logits[2, 5] = math.inf
    logits[3, :29] = -math.inf     # a model may mask tokens: one finite logit still draws
    params = SamplingParams(max_tokens=1, seed=1)
    segments = [tokens.Segment(range(i, i + 1), params, torch.Generator().manual_seed(i))
                for i in range(4)]
    drawn = tokens.draw(logits, segments, topk=2)
    assert [drawn.finite(i) for i in range(4)] == [True, False, False, True]
    assert drawn.tokens[3] == 29 and drawn.logprobs[3] == pytest.approx(0.0)
    assert math.isfinite(drawn.logprobs[0])
    everything_masked = torch.full((1, 30), -math.inf)
    assert not tokens.draw(everything_masked, segments[:1], topk=0).finite(0)


def test_the_error_of_non_finite_logits_names_the_model():
    def request(adapter, path):
        return SampleRequest(adapter, path, torch.zeros(1).numpy(), 1, SamplingParams())
    error = tokens.not_finite(request("run-7", None))
    assert isinstance(error, FailedPrecondition)
    assert "model 'run-7'" in str(error) and "not finite" in str(error)
    assert "'step-3'" in str(tokens.not_finite(request(None, "/data/run/sampler/step-3")))
    assert "the base model" in str(tokens.not_finite(request(None, None)))


def test_a_row_stops_at_a_stop_token_a_stop_string_or_max_tokens():
    params = SamplingParams(max_tokens=4, stop_strings=("cd",))
    text = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    assert tokens.stop_reason([0, 9], params, {9}, text) == tokens.Stop("stop")
    assert tokens.stop_reason([1, 2, 3], params, set(), text) == tokens.Stop("stop", 1)  # 'bcd'
    assert tokens.stop_reason([0, 0, 0, 0], params, set(), text) == tokens.Stop("length")
    assert tokens.stop_reason([0, 0], params, set(), text) is None


def test_the_stop_names_where_the_earliest_stop_string_begins_in_the_text():
    params = SamplingParams(max_tokens=9, stop_strings=("ef", "cd", "zz"))
    text = lambda ids: "".join(chr(ord("a") + i) for i in ids)  # noqa: E731
    assert tokens.stop_reason([0, 1, 2, 3, 4, 5], params, set(), text) == tokens.Stop("stop", 2)
