"""Each loss against a hand computation in numpy from the same logprobs and inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.losses import compute_loss, validate_loss
from twinkle_server.engine.types import Datum, LossSpec

RNG = np.random.default_rng(0)
LENGTHS = (5, 9, 3)


def _case():
    """Logprobs whose ratios land below, inside and above the clip ranges."""
    logp = [RNG.uniform(-3, -0.1, n) for n in LENGTHS]
    shift = [RNG.choice([-0.7, -0.05, 0.0, 0.05, 0.7], n) for n in LENGTHS]
    old = [lp - s for lp, s in zip(logp, shift, strict=True)]
    adv = [RNG.choice([-1.5, -0.2, 0.4, 2.0], n) for n in LENGTHS]
    weights = [RNG.choice([0.0, 0.3, 1.0, 2.5], n) for n in LENGTHS]
    return logp, old, adv, weights


def _run(name, logp, old, adv, weights, config=None, micro=1):
    lps = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in logp]
    inputs = [{"target_tokens": torch.zeros(len(x), dtype=torch.long),
               "weights": torch.tensor(w), "logprobs": torch.tensor(o),
               "advantages": torch.tensor(a)}
              for x, o, a, w in zip(logp, old, adv, weights, strict=True)]
    loss, metrics = compute_loss(LossSpec(name, config or {}), lps, inputs, micro)
    loss.backward()
    return float(loss.detach()), metrics, [lp.grad.numpy() for lp in lps]


def test_cross_entropy_is_the_weighted_sum_with_any_float_weights():
    logp, old, adv, w = _case()
    loss, metrics, grads = _run("cross_entropy", logp, old, adv, w)
    expected = -sum((lp * wi).sum() for lp, wi in zip(logp, w, strict=True))
    assert loss == pytest.approx(expected, rel=1e-9)
    assert metrics["loss:sum"] == pytest.approx(expected, rel=1e-6)
    for g, wi in zip(grads, w, strict=True):
        np.testing.assert_allclose(g, -wi)


def test_importance_sampling_is_minus_ratio_times_advantage():
    logp, old, adv, w = _case()
    loss, _, _ = _run("importance_sampling", logp, old, adv, w)
    expected = -sum((np.exp(lp - o) * a).sum() for lp, o, a in zip(logp, old, adv, strict=True))
    assert loss == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("config", "lo", "hi"),
                         [({}, 0.8, 1.2), ({"clip_low_threshold": 0.9,
                                           "clip_high_threshold": 1.1}, 0.9, 1.1)])
def test_ppo_takes_the_pessimistic_clipped_term(config, lo, hi):
    logp, old, adv, w = _case()
    loss, metrics, _ = _run("ppo", logp, old, adv, w, config)
    expected = 0.0
    for lp, o, a in zip(logp, old, adv, strict=True):
        r = np.exp(lp - o)
        expected -= np.minimum(r * a, np.clip(r, lo, hi) * a).sum()
    assert loss == pytest.approx(expected, rel=1e-9)
    ratios = np.concatenate([np.exp(lp - o) for lp, o in zip(logp, old, strict=True)])
    assert (ratios < lo).any() and (ratios > hi).any()
    assert 0.0 < metrics["clip_fraction:mean"] < 1.0


def test_cispo_detaches_the_clipped_ratio():
    logp, old, adv, w = _case()
    loss, _, grads = _run("cispo", logp, old, adv, w, {"clip_high_threshold": 1.3})
    expected = 0.0
    for lp, o, a, g in zip(logp, old, adv, grads, strict=True):
        c = np.clip(np.exp(lp - o), 0.0, 1.3)
        expected -= (c * lp * a).sum()
        np.testing.assert_allclose(g, -c * a, rtol=1e-9)
    assert loss == pytest.approx(expected, rel=1e-9)


def test_dro_adds_the_quadratic_penalty_with_beta():
    logp, old, adv, w = _case()
    loss, _, _ = _run("dro", logp, old, adv, w, {"beta": 0.3})
    expected = -sum((lp * a - 0.5 * 0.3 * (lp - o) ** 2).sum()
                    for lp, o, a in zip(logp, old, adv, strict=True))
    assert loss == pytest.approx(expected, rel=1e-9)


def test_native_cross_entropy_is_a_token_mean_divided_by_micro_batches():
    logp, old, adv, w = _case()
    loss, metrics, _ = _run("CrossEntropyLoss", logp, old, adv, w, micro=2)
    total_w = sum(wi.sum() for wi in w)
    expected = -sum((lp * wi).sum() for lp, wi in zip(logp, w, strict=True)) / total_w / 2
    assert loss == pytest.approx(expected, rel=1e-9)
    assert "loss:mean" in metrics


def test_native_cross_entropy_with_no_weighted_tokens_is_zero_not_nan():
    logp, old, adv, w = _case()
    loss, _, _ = _run("CrossEntropyLoss", logp, old, adv, [np.zeros_like(x) for x in w])
    assert loss == 0.0


def test_grpo_averages_tokens_per_sequence_then_sequences():
    logp, old, adv, w = _case()
    loss, _, _ = _run("GRPOLoss", logp, old, adv, w, {"epsilon": 0.2, "epsilon_high": 0.28})
    means = []
    for lp, o, a, wi in zip(logp, old, adv, w, strict=True):
        r = np.exp(lp - o)
        term = np.minimum(r * a, np.clip(r, 0.8, 1.28) * a)
        mask = wi > 0
        if mask.any():
            means.append(term[mask].mean())
    assert loss == pytest.approx(-np.mean(means), rel=1e-9)


def _datum(n, **inputs):
    return Datum(np.zeros(n, np.int64), {"target_tokens": np.zeros(n, np.int64), **inputs})


@pytest.mark.parametrize(("spec", "datum", "message"), [
    (LossSpec("hinge"), _datum(2), "unknown loss 'hinge'; valid losses are"),
    (LossSpec("ppo"), _datum(2, logprobs=np.zeros(2, np.float32)),
     r"datum\[0\].loss_fn_inputs: ppo needs 'advantages'"),
    (LossSpec("ppo", {"clip": 0.1}), _datum(2), "'clip' is not a parameter of ppo"),
    (LossSpec("dro", {"beta": float("nan")}), _datum(2), "beta: must be finite"),
    (LossSpec("cross_entropy"), _datum(3, weights=np.ones(2, np.float32)),
     r"\['weights'\]: shape \[2\] differs from target_tokens' \[3\]"),
    (LossSpec("importance_sampling"),
     _datum(2, logprobs=np.zeros(2, np.float32), advantages=np.array([1.0, np.nan], np.float32)),
     r"\['advantages'\]: contains NaN or infinity"),
])
def test_validate_loss_names_the_field(spec, datum, message):
    with pytest.raises(InvalidArgument, match=message):
        validate_loss(spec, [datum])
