"""Each loss against a hand computation in numpy from the same logprobs and inputs.

The reference formulas are written out here in numpy, independently of the torch code,
so a change of semantics (a hidden mean, a missing clip branch) fails a test.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.losses import LOSS_NAMES, compute_loss, validate_loss
from twinkle_server.engine.types import Datum, LossSpec

SHIFTS = (-0.7, -0.05, 0.0, 0.05, 0.7)   # logp - old_logp: ratio 0.50, 0.95, 1, 1.05, 2.01
ADVANTAGES = (-1.5, -0.2, 0.4, 2.0)


def _case(seed: int = 0):
    """Three datums of different lengths; the first holds every (ratio, advantage) pair so
    both clip regions meet both signs of advantage; weights are non-binary."""
    rng = np.random.default_rng(seed)
    grid = np.array(list(itertools.product(SHIFTS, ADVANTAGES)))
    shifts = [grid[:, 0], rng.choice(SHIFTS, 7), rng.choice(SHIFTS, 3)]
    adv = [grid[:, 1], rng.choice(ADVANTAGES, 7), rng.choice(ADVANTAGES, 3)]
    logp = [rng.uniform(-3, -0.1, len(s)) for s in shifts]
    old = [lp - s for lp, s in zip(logp, shifts, strict=True)]
    weights = [rng.choice([0.0, 0.3, 1.0, 2.5], len(s)) for s in shifts]
    weights[2][:] = 0.0  # one sequence with no weighted token
    return logp, old, adv, weights


_MASKS = {"gspo": "sequence_ratio_mask", "stable_reinforce": "sampled_mask"}


def _run(name, logp, old, adv, weights, config=None, micro=1, masks=None):
    """compute_loss in float64 and backward; returns loss, metrics, d loss / d logp.
    `masks` (gspo's sequence_ratio_mask, stable_reinforce's sampled_mask) default to
    every position; a None entry leaves that datum's mask out."""
    lps = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in logp]
    inputs = []
    masks = masks or [np.ones(len(x)) for x in logp]
    for x, o, a, w, m in zip(logp, old, adv, weights, masks, strict=True):
        item = {"target_tokens": torch.zeros(x.shape, dtype=torch.long),
                "logprobs": torch.tensor(o), "advantages": torch.tensor(a)}
        if w is not None:
            item["weights"] = torch.tensor(w)
        if name in _MASKS and m is not None:  # None: the datum sends no mask
            item[_MASKS[name]] = torch.tensor(m)
        inputs.append(item)
    loss, metrics = compute_loss(LossSpec(name, config or {}), lps, inputs, micro)
    loss.backward()
    return float(loss.detach()), metrics, [lp.grad.numpy() for lp in lps]


def _zip(*arrays):
    return zip(*arrays, strict=True)


def test_cross_entropy_is_the_weighted_sum_with_gradient_minus_weights():
    logp, old, adv, w = _case()
    loss, metrics, grads = _run("cross_entropy", logp, old, adv, w)
    expected = -sum((lp * wi).sum() for lp, wi in _zip(logp, w))
    assert loss == pytest.approx(expected, rel=1e-12)
    assert metrics["loss:sum"] == pytest.approx(expected, rel=1e-12)
    assert metrics["tokens:sum"] == sum(float((wi != 0).sum()) for wi in w)
    for g, wi in _zip(grads, w):
        np.testing.assert_allclose(g, -wi, rtol=1e-12)


def test_cross_entropy_without_weights_counts_every_token_once():
    logp, old, adv, _ = _case()
    loss, metrics, _ = _run("cross_entropy", logp, old, adv, [None] * len(logp))
    assert loss == pytest.approx(-sum(lp.sum() for lp in logp), rel=1e-12)
    assert metrics["tokens:sum"] == sum(len(lp) for lp in logp)


def test_cross_entropy_accepts_two_dimensional_targets():
    rng = np.random.default_rng(1)
    logp, w = rng.uniform(-3, 0, (4, 3)), rng.uniform(0, 2, (4, 3))
    loss, _, grads = _run("cross_entropy", [logp], [logp], [np.zeros_like(logp)], [w])
    assert loss == pytest.approx(-(logp * w).sum(), rel=1e-12)
    np.testing.assert_allclose(grads[0], -w, rtol=1e-12)


def test_importance_sampling_is_minus_ratio_times_advantage_ignoring_weights():
    logp, old, adv, w = _case()
    loss, metrics, grads = _run("importance_sampling", logp, old, adv, w)
    ratio = [np.exp(lp - o) for lp, o in _zip(logp, old)]
    assert loss == pytest.approx(-sum((r * a).sum() for r, a in _zip(ratio, adv)), rel=1e-12)
    for g, r, a in _zip(grads, ratio, adv):
        np.testing.assert_allclose(g, -r * a, rtol=1e-12)  # d ratio / d logp = ratio
    active = np.concatenate(w) != 0
    assert metrics["ratio:mean"] == pytest.approx(np.concatenate(ratio)[active].mean())
    assert metrics["clip_fraction:mean"] == 0.0


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo"])
def test_without_weights_the_ratio_metrics_are_over_the_positions_with_an_advantage(name):
    """The cookbook's RL datum sends no weights: its prompt positions carry old logprob 0
    and advantage 0, score nothing, and are left out of `ratio:mean` and
    `clip_fraction:mean` (once they were counted, each a ratio of exp(logp) near 0)."""
    logp = [np.array([-4.0, -3.0, -0.5, -0.7, -0.2]), np.array([-5.0, -0.3, -0.4])]
    old = [np.array([0.0, 0.0, -0.55, -0.6, -0.9]), np.array([0.0, -0.31, -0.41])]
    adv = [np.array([0.0, 0.0, 1.0, 1.0, 1.0]), np.array([0.0, -0.5, -0.5])]
    _, metrics, _ = _run(name, logp, old, adv, [None, None])
    ratios = np.exp(np.concatenate(logp) - np.concatenate(old))[np.concatenate(adv) != 0]
    assert metrics["ratio:mean"] == pytest.approx(ratios.mean(), rel=1e-12)
    if name != "importance_sampling":
        lo, hi = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}[name]
        assert metrics["clip_fraction:mean"] == pytest.approx(
            ((ratios < lo) | (ratios > hi)).mean())


@pytest.mark.parametrize(("config", "lo", "hi"),
                         [({}, 0.8, 1.2), ({"clip_low_threshold": 0.9,
                                           "clip_high_threshold": 1.1}, 0.9, 1.1)])
def test_ppo_takes_the_pessimistic_clipped_term_in_both_regions(config, lo, hi):
    logp, old, adv, w = _case()
    loss, metrics, grads = _run("ppo", logp, old, adv, w, config)
    expected = 0.0
    for lp, o, a, g in _zip(logp, old, adv, grads):
        r = np.exp(lp - o)
        unclipped, clipped = r * a, np.clip(r, lo, hi) * a
        expected -= np.minimum(unclipped, clipped).sum()
        # The gradient flows only where the unclipped term is the smaller one.
        np.testing.assert_allclose(g, np.where(unclipped <= clipped, -r * a, 0.0), rtol=1e-12)
    assert loss == pytest.approx(expected, rel=1e-12)
    r0, a0 = np.exp(logp[0] - old[0]), adv[0]
    # Every combination is present: clipped away (no gradient) and kept, low and high.
    assert ((r0 > hi) & (a0 > 0)).any() and ((r0 < lo) & (a0 < 0)).any()
    assert ((r0 > hi) & (a0 < 0)).any() and ((r0 < lo) & (a0 > 0)).any()
    ratios, active = np.concatenate([np.exp(lp - o) for lp, o in _zip(logp, old)]), \
        np.concatenate(w) != 0
    assert metrics["clip_fraction:mean"] == pytest.approx(
        ((ratios[active] < lo) | (ratios[active] > hi)).mean())


def test_cispo_detaches_the_clipped_ratio_so_the_gradient_is_clip_times_advantage():
    logp, old, adv, w = _case()
    loss, metrics, grads = _run("cispo", logp, old, adv, w, {"clip_high_threshold": 1.3})
    expected = 0.0
    for lp, o, a, g in _zip(logp, old, adv, grads):
        c = np.clip(np.exp(lp - o), 0.0, 1.3)
        expected -= (c * lp * a).sum()
        np.testing.assert_allclose(g, -c * a, rtol=1e-12)
    assert loss == pytest.approx(expected, rel=1e-12)
    assert 0.0 < metrics["clip_fraction:mean"] < 1.0


def test_cispo_defaults_clip_at_four():
    logp, old, adv, w = _case()
    loss, _, _ = _run("cispo", logp, [lp - 2.0 for lp in logp], adv, w)  # ratio e^2 = 7.39
    assert loss == pytest.approx(-sum((4.0 * lp * a).sum() for lp, a in _zip(logp, adv)))


@pytest.mark.parametrize(("config", "beta"), [({"beta": 0.3}, 0.3), ({}, 1.0)])
def test_dro_adds_the_quadratic_penalty_with_beta(config, beta):
    logp, old, adv, w = _case()
    loss, _, grads = _run("dro", logp, old, adv, w, config)
    expected = -sum((lp * a - 0.5 * beta * (lp - o) ** 2).sum()
                    for lp, o, a in _zip(logp, old, adv))
    assert loss == pytest.approx(expected, rel=1e-12)
    for g, lp, o, a in _zip(grads, logp, old, adv):
        np.testing.assert_allclose(g, -(a - beta * (lp - o)), rtol=1e-12)


def test_native_cross_entropy_is_a_token_mean_divided_by_micro_batches():
    logp, old, adv, w = _case()
    loss, metrics, _ = _run("CrossEntropyLoss", logp, old, adv, w, micro=2)
    total_w = sum(wi.sum() for wi in w)
    expected = -sum((lp * wi).sum() for lp, wi in _zip(logp, w)) / total_w / 2
    assert loss == pytest.approx(expected, rel=1e-12)
    assert metrics["loss:mean"] == pytest.approx(expected, rel=1e-12)
    assert "loss:sum" not in metrics


def test_native_cross_entropy_two_micro_batches_accumulate_to_one_batch():
    rng = np.random.default_rng(2)
    logp = [rng.uniform(-3, 0, n) for n in (3, 5, 8)]
    w = [np.ones(n) for n in (3, 5, 8)]  # micro-batches {0, 1} and {2} weigh 8 each
    zeros = [np.zeros_like(x) for x in logp]
    _, _, whole = _run("CrossEntropyLoss", logp, zeros, zeros, w, micro=1)
    _, _, first = _run("CrossEntropyLoss", logp[:2], zeros[:2], zeros[:2], w[:2], micro=2)
    _, _, second = _run("CrossEntropyLoss", logp[2:], zeros[2:], zeros[2:], w[2:], micro=2)
    for g, acc in _zip(whole, first + second):
        np.testing.assert_allclose(g, acc, rtol=1e-12)


def test_native_cross_entropy_with_no_weighted_tokens_is_zero_not_nan():
    logp, old, adv, w = _case()
    loss, metrics, grads = _run("CrossEntropyLoss", logp, old, adv, [np.zeros_like(x) for x in w])
    assert loss == 0.0 and metrics["loss:mean"] == 0.0 and metrics["tokens:sum"] == 0.0
    assert all(np.all(g == 0) for g in grads)


def _grpo_reference(logp, old, adv, w, lo, hi):
    means = []
    for lp, o, a, wi in _zip(logp, old, adv, w):
        r = np.exp(lp - o)
        term = np.minimum(r * a, np.clip(r, lo, hi) * a)
        if (wi > 0).any():
            means.append(term[wi > 0].mean())
    return -np.mean(means)


def test_grpo_averages_tokens_per_sequence_then_sequences():
    logp, old, adv, w = _case()
    loss, metrics, _ = _run("GRPOLoss", logp, old, adv, w, {"epsilon": 0.2,
                                                            "epsilon_high": 0.28})
    expected = _grpo_reference(logp, old, adv, w, 0.8, 1.28)
    assert loss == pytest.approx(expected, rel=1e-12)
    assert metrics["loss:mean"] == pytest.approx(expected, rel=1e-12)
    # A flat token mean over the batch weighs the 20-token sequence more: not the same.
    flat = np.concatenate(w) > 0
    r = np.concatenate([np.exp(lp - o) for lp, o in _zip(logp, old)])
    a = np.concatenate(adv)
    assert not math.isclose(loss, -np.minimum(r * a, np.clip(r, 0.8, 1.28) * a)[flat].mean(),
                            rel_tol=1e-3)


def test_grpo_epsilon_high_defaults_to_epsilon_and_divides_by_micro_batches():
    logp, old, adv, w = _case()
    loss, _, _ = _run("GRPOLoss", logp, old, adv, w, {"epsilon": 0.1}, micro=3)
    assert loss == pytest.approx(_grpo_reference(logp, old, adv, w, 0.9, 1.1) / 3, rel=1e-12)
    default, _, _ = _run("GRPOLoss", logp, old, adv, w)
    assert default == pytest.approx(_grpo_reference(logp, old, adv, w, 0.8, 1.2), rel=1e-12)


def test_tinker_losses_ignore_num_micro_batches():
    logp, old, adv, w = _case()
    for name in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro"):
        one, _, _ = _run(name, logp, old, adv, w, micro=1)
        four, _, _ = _run(name, logp, old, adv, w, micro=4)
        assert one == four, name


@pytest.mark.parametrize("name", sorted(LOSS_NAMES))
def test_every_loss_reports_finite_metrics_under_name_reduction_keys(name):
    logp, old, adv, w = _case(seed=3)
    _, metrics, _ = _run(name, logp, old, adv, w)
    loss_key = "loss:mean" if name in ("CrossEntropyLoss", "GRPOLoss") else "loss:sum"
    expected = {loss_key, "tokens:sum"}
    if name not in ("cross_entropy", "CrossEntropyLoss"):
        expected |= {"ratio:mean", "clip_fraction:mean"}
    if name == "stable_reinforce":
        expected |= {"kl:mean"}
    assert set(metrics) == expected
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


def test_compute_loss_rejects_a_bad_micro_batch_count_and_mismatched_logprobs():
    lp = [torch.zeros(3, requires_grad=True)]
    inputs = [{"target_tokens": torch.zeros(3, dtype=torch.long)}]
    with pytest.raises(InvalidArgument, match="num_micro_batches: must be an integer >= 1"):
        compute_loss(LossSpec("CrossEntropyLoss"), lp, inputs, 0)
    with pytest.raises(InvalidArgument, match=r"logprobs shape \[2\] differs"):
        compute_loss(LossSpec("cross_entropy"), [torch.zeros(2)], inputs)


def _datum(n, **inputs):
    return Datum(np.zeros(n, np.int64), {"target_tokens": np.zeros(n, np.int64), **inputs})


_RL = {"logprobs": np.zeros(2, np.float32), "advantages": np.ones(2, np.float32)}


@pytest.mark.parametrize(("spec", "datum", "message"), [
    (LossSpec("hinge"), _datum(2),
     r"unknown loss 'hinge'; valid losses are \['CrossEntropyLoss', 'GRPOLoss', 'cispo'"),
    (LossSpec("ppo"), _datum(2, logprobs=np.zeros(2, np.float32)),
     r"datum\[0\].loss_fn_inputs: ppo needs 'advantages'"),
    (LossSpec("importance_sampling"), _datum(2, advantages=np.zeros(2, np.float32)),
     r"datum\[0\].loss_fn_inputs: importance_sampling needs 'logprobs'"),
    (LossSpec("ppo", {"clip": 0.1}), _datum(2, **_RL),
     r"'clip' is not a parameter of ppo \(it takes \['clip_high_threshold'"),
    (LossSpec("cross_entropy", {"beta": 1.0}), _datum(2),
     "not a parameter of cross_entropy .it takes no parameters"),
    (LossSpec("dro", {"beta": float("nan")}), _datum(2, **_RL), "beta: must be finite"),
    (LossSpec("dro", {"beta": -0.5}), _datum(2, **_RL), "beta: must be >= 0"),
    (LossSpec("dro", {"beta": "1"}), _datum(2, **_RL), "beta: must be a number, got str"),
    (LossSpec("GRPOLoss", {"epsilon": float("inf")}), _datum(2, **_RL), "epsilon: must be fin"),
    (LossSpec("ppo", {"clip_low_threshold": 1.3}), _datum(2, **_RL),
     "clip_low_threshold 1.3 is above clip_high_threshold 1.2"),
    (LossSpec("cross_entropy"), _datum(3, weights=np.ones(2, np.float32)),
     r"datum\[0\].loss_fn_inputs\['weights'\]: shape \[2\] differs from target_tokens' \[3\]"),
    (LossSpec("cross_entropy"),
     Datum(np.zeros(2, np.int64), {"target_tokens": np.zeros((2, 3), np.int64),
                                   "weights": np.ones((2, 2), np.float32)}),
     r"\['weights'\]: shape \[2, 2\] differs from target_tokens' \[2, 3\]"),
    (LossSpec("cross_entropy"), Datum(np.zeros(2, np.int64),
                                      {"target_tokens": np.zeros(2, np.float32)}),
     r"\['target_tokens'\]: must be integer"),
    (LossSpec("importance_sampling"),
     _datum(2, logprobs=np.zeros(2, np.float32), advantages=np.array([1.0, np.nan], np.float32)),
     r"datum\[0\].loss_fn_inputs\['advantages'\]: contains NaN or infinity"),
    (LossSpec("cross_entropy"), _datum(2, weights=np.array([np.inf, 1.0], np.float32)),
     r"\['weights'\]: contains NaN or infinity"),
    # The SDK knows per-token clip thresholds as inputs; no loss here reads them there.
    (LossSpec("ppo"), _datum(2, **_RL, clip_low_threshold=np.full(2, 0.5, np.float32)),
     r"datum\[0\].loss_fn_inputs\['clip_low_threshold'\]: no loss reads it; ppo reads "
     r"\['advantages', 'logprobs', 'target_tokens', 'weights'\] \(its clip thresholds are "
     r"loss_fn_config keys\)"),
    (LossSpec("cross_entropy"), _datum(2, mask=np.ones(2, np.float32)),
     r"datum\[0\].loss_fn_inputs\['mask'\]: no loss reads it"),
])
def test_validate_loss_names_the_field(spec, datum, message):
    with pytest.raises(InvalidArgument, match=message):
        validate_loss(spec, [datum])


def test_validate_loss_names_the_index_of_the_bad_datum():
    good = _datum(2, **_RL)
    bad = _datum(2, logprobs=np.array([0.0, -np.inf], np.float32),
                 advantages=np.ones(2, np.float32))
    with pytest.raises(InvalidArgument, match=r"datum\[1\].loss_fn_inputs\['logprobs'\]"):
        validate_loss(LossSpec("ppo"), [good, bad])


def test_validate_loss_accepts_well_formed_inputs_for_every_loss():
    masks = {key: np.ones(2, np.float32) for key in _MASKS.values()}
    for name in LOSS_NAMES:
        validate_loss(LossSpec(name), [_datum(2, weights=np.ones(2, np.float32), **_RL,
                                              **masks)])
    validate_loss(LossSpec("GRPOLoss", {"epsilon": 0.2, "epsilon_high": 0.28}),
                  [_datum(2, **_RL)])


# ----------------------------------------------------------------------------- gspo
# References in float64 numpy against compute_loss in float64: both sides round only a
# handful of operations per value (~1e-16 relative each), so rel=1e-12 leaves a margin
# of a thousand without letting any change of formula through.


def _gspo_reference(logp, old, adv, mask, lo=0.8, hi=1.2):
    """Tinker's GSPO-token by hand: (loss, d loss / d logp) of one datum. Each token's
    ratio has the sequence ratio s as its value and d s_t / d logp_t = s; the min picks
    the unclipped term's gradient unless the clipped term is smaller and s is outside
    [lo, hi] (then the clipped term is a constant)."""
    s = math.exp(float(np.mean((logp - old)[mask != 0])))
    clipped = min(max(s, lo), hi)
    loss = -np.minimum(s * adv, clipped * adv).sum()
    live = (s * adv <= clipped * adv) | ((lo <= s) & (s <= hi))
    return loss, np.where(live, -s * adv, 0.0), s


def _gspo_case():
    """Three datums: one whose sequence ratio is inside [0.8, 1.2], one above it and one
    below it; advantages of both signs; the mask leaves out prompt-like positions whose
    log-ratios are large, so a mask that were ignored would change s."""
    logp = [np.array([-1.0, -2.0, -0.5, -0.3, -1.2]), np.array([-0.4, -0.9, -1.5, -2.2]),
            np.array([-1.1, -0.6, -0.8])]
    shifts = [np.array([3.0, 0.05, 0.1, -0.05, 0.02]), np.array([-4.0, 0.6, 0.5, 0.7]),
              np.array([-0.5, -0.4, -0.45])]
    old = [lp - sh for lp, sh in _zip(logp, shifts)]
    adv = [np.array([0.0, 1.0, -2.0, 0.5, 1.5]), np.array([0.0, 1.0, -1.0, 2.0]),
           np.array([-1.0, 1.0, 0.5])]
    mask = [np.array([0.0, 1, 1, 1, 1]), np.array([0.0, 1, 1, 1]), np.array([1.0, 1, 1])]
    return logp, old, adv, mask


def test_gspo_is_tinkers_gspo_token_with_one_clipped_sequence_ratio_per_datum():
    logp, old, adv, mask = _gspo_case()
    loss, metrics, grads = _run("gspo", logp, old, adv, [None] * 3, masks=mask)
    refs = [_gspo_reference(*args) for args in _zip(logp, old, adv, mask)]
    ratios = [r[2] for r in refs]
    assert ratios[0] == pytest.approx(math.exp(0.03), rel=1e-12)  # inside the clip range
    assert ratios[1] > 1.2 and ratios[2] < 0.8                     # above, below
    assert loss == pytest.approx(sum(r[0] for r in refs), rel=1e-12)
    assert metrics["loss:sum"] == pytest.approx(loss, rel=1e-12)
    for g, (_, expected, _) in _zip(grads, refs):
        np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-15)
    # Every position carries its datum's ratio; the metrics count those with an
    # advantage (no weights sent): 4 + 3 + 3 tokens, 6 outside [0.8, 1.2].
    assert metrics["ratio:mean"] == pytest.approx((4 * ratios[0] + 3 * ratios[1]
                                                   + 3 * ratios[2]) / 10, rel=1e-12)
    assert metrics["clip_fraction:mean"] == pytest.approx(6 / 10)


def test_gspo_takes_its_clip_thresholds_from_the_config():
    logp, old, adv, mask = _gspo_case()
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}
    loss, _, grads = _run("gspo", logp, old, adv, [None] * 3, config, masks=mask)
    refs = [_gspo_reference(*args, lo=0.5, hi=3.0) for args in _zip(logp, old, adv, mask)]
    assert loss == pytest.approx(sum(r[0] for r in refs), rel=1e-12)
    for g, (_, expected, _) in _zip(grads, refs):
        np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-15)


def _rl_loop_datum(prompt_len, sampled_logp, advantage, shift):
    """A datum laid out as tinker-cookbook 0.6.1's recipes/rl_loop.py lays it out: the
    prompt's positions carry old logprob 0.0 and advantage 0, the sampled tokens their
    sampler logprobs and the sequence's advantage; with gspo rl_loop sends
    sequence_ratio_mask = [0] * prompt + [1] * sampled. The prompt's log-ratios are
    large, so a ratio taken over them would differ. Returns (logp, old, adv, that mask)."""
    prompt_logp = np.linspace(-4.0, -2.0, prompt_len)
    logp = np.r_[prompt_logp, sampled_logp]
    old = np.r_[np.zeros(prompt_len), sampled_logp - shift]
    adv = np.r_[np.zeros(prompt_len), np.full(len(sampled_logp), advantage)]
    mask = np.r_[np.zeros(prompt_len), np.ones(len(sampled_logp))]
    return logp, old, adv, mask


def test_gspo_without_a_mask_takes_the_ratio_over_the_positions_with_nonzero_advantage():
    # cookbook 0.6.1's rl.train sends gspo datums with no sequence_ratio_mask (it strips
    # its own "mask"); rl_loop.py marks the sampled tokens, which are exactly the positions
    # with non-zero advantage. Datums: s inside, above and below [0.8, 1.2], and one
    # sequence whose reward equals its group's mean (advantage 0 everywhere).
    rows = [_rl_loop_datum(3, np.array([-0.5, -1.2, -0.1, -0.9]), 1.5, 0.05),
            _rl_loop_datum(2, np.array([-0.3, -0.7, -2.0]), -0.5, np.array([0.6, 0.5, 0.7])),
            _rl_loop_datum(4, np.array([-1.1, -0.6]), 2.0, -0.45),
            _rl_loop_datum(2, np.array([-0.8, -1.3, -0.2]), 0.0, 0.3)]
    logp, old, adv, rl_loop_mask = (list(col) for col in zip(*rows, strict=True))
    loss, metrics, grads = _run("gspo", logp, old, adv, [None] * 4, masks=[None] * 4)
    assert all(math.isfinite(v) for v in metrics.values())
    # The reference is rl_loop's own mask, computed by hand.
    refs = [_gspo_reference(*args) for args in _zip(logp, old, adv, rl_loop_mask)]
    assert refs[0][2] == pytest.approx(math.exp(0.05), rel=1e-12)
    assert refs[1][2] > 1.2 and refs[2][2] < 0.8
    assert refs[3][0] == 0.0 and not refs[3][1].any()  # advantage 0: nothing to train
    assert loss == pytest.approx(sum(r[0] for r in refs), rel=1e-12)
    for g, (_, expected, _) in _zip(grads, refs):
        np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-15)
    # The same batch with rl_loop's mask sent gives the same loss and gradients; so does
    # a batch that sends it for some datums only.
    for masks in (rl_loop_mask, [rl_loop_mask[0], None, rl_loop_mask[2], None]):
        loss_m, _, grads_m = _run("gspo", logp, old, adv, [None] * 4, masks=masks)
        assert loss_m == pytest.approx(loss, rel=1e-12)
        for g, g_m in _zip(grads, grads_m):
            np.testing.assert_allclose(g, g_m, rtol=1e-12, atol=1e-15)
    # And validation lets the unmasked datums through, the all-zero-advantage one too.
    validate_loss(LossSpec("gspo"), [
        _datum(len(lp), logprobs=o.astype(np.float32), advantages=a.astype(np.float32))
        for lp, o, a in _zip(logp, old, adv)])


# ----------------------------------------------------------------------------- stable_reinforce


def _stable_reference(logp, q, adv, sampled, cap=2.0, kl_coeff=0.0):
    """(loss, d loss / d logp) by hand: truncated-IS REINFORCE plus kl_coeff * k3, over
    the sampled positions only."""
    rho = np.exp(logp - q)
    weight = np.minimum(rho, cap)
    keep = sampled != 0
    loss = np.where(keep, -weight * adv * logp + kl_coeff * (rho - 1 - np.log(rho)), 0).sum()
    grad = np.where(keep, -weight * adv + kl_coeff * (rho - 1), 0.0)
    return loss, grad


@pytest.mark.parametrize("config", [{}, {"kl_coeff": 0.1}, {"kl_coeff": 1.0,
                                                             "clip_high_threshold": 1.5}])
def test_stable_reinforce_truncates_the_weight_and_penalises_kl_to_the_sampler(config):
    logp, old, adv, _ = _case(seed=5)
    # A prompt position of each datum: not sampled, its huge log-ratio must not count.
    sampled = [np.r_[0.0, np.ones(len(lp) - 1)] for lp in logp]
    for o in old:
        o[0] = -60.0
    loss, metrics, grads = _run("stable_reinforce", logp, old, adv, [None] * 3, config,
                                masks=sampled)
    cap, beta = config.get("clip_high_threshold", 2.0), config.get("kl_coeff", 0.0)
    refs = [_stable_reference(lp, q, a, m, cap, beta)
            for lp, q, a, m in _zip(logp, old, adv, sampled)]
    assert loss == pytest.approx(sum(r[0] for r in refs), rel=1e-12)
    for g, (_, expected) in _zip(grads, refs):
        np.testing.assert_allclose(g, expected, rtol=1e-12, atol=1e-15)
    rho = np.concatenate([np.exp(lp - q)[1:] for lp, q in _zip(logp, old)])
    assert metrics["tokens:sum"] == len(rho)
    assert metrics["ratio:mean"] == pytest.approx(rho.mean(), rel=1e-12)
    assert metrics["clip_fraction:mean"] == pytest.approx(float((rho > cap).mean()))
    assert metrics["kl:mean"] == pytest.approx((rho - 1 - np.log(rho)).mean(), rel=1e-12)


def test_stable_reinforce_on_policy_is_reinforce():
    logp = [np.array([-0.5, -1.5, -2.5])]
    loss, _, grads = _run("stable_reinforce", logp, logp, [np.array([1.0, -2.0, 0.5])],
                          [None], {"kl_coeff": 0.3})
    assert loss == pytest.approx(-(logp[0] * [1.0, -2.0, 0.5]).sum(), rel=1e-12)
    np.testing.assert_allclose(grads[0], [-1.0, 2.0, -0.5], rtol=1e-12)


@pytest.mark.parametrize(("spec", "datum", "message"), [
    (LossSpec("gspo"), _datum(2, **_RL, sequence_ratio_mask=np.zeros(2, np.float32)),
     r"\['sequence_ratio_mask'\]: marks no position"),
    (LossSpec("gspo"), _datum(2, **_RL, sequence_ratio_mask=np.ones(3, np.float32)),
     r"\['sequence_ratio_mask'\]: shape \[3\] differs from target_tokens' \[2\]"),
    (LossSpec("gspo"), Datum(np.zeros(2, np.int64), {
        "target_tokens": np.zeros((2, 2), np.int64), "logprobs": np.zeros((2, 2), np.float32),
        "advantages": np.zeros((2, 2), np.float32),
        "sequence_ratio_mask": np.ones((2, 2), np.float32)}),
     r"gspo takes one target per position \(\[T\]\), got shape \[2, 2\]"),
    (LossSpec("stable_reinforce"), _datum(2, **_RL),
     r"stable_reinforce needs 'sampled_mask'"),
    (LossSpec("stable_reinforce", {"kl_coeff": -1.0}), _datum(2, **_RL),
     "kl_coeff: must be >= 0"),
    (LossSpec("stable_reinforce", {"beta": 1.0}), _datum(2, **_RL),
     r"'beta' is not a parameter of stable_reinforce \(it takes \['clip_high_threshold', "
     r"'kl_coeff'\]\)"),
])
def test_validate_loss_refuses_bad_gspo_and_stable_reinforce_inputs(spec, datum, message):
    with pytest.raises(InvalidArgument, match=message):
        validate_loss(spec, [datum])
