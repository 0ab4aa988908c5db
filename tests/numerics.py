"""Tolerances for numbers that two different computations must agree on.

They are the isolation contract's (top of `twinkle_server/engine/engine.py`): a merged
pass against a pass alone, padded against unpadded, the server against the engine, the
engine against PEFT. Such pairs run GEMMs of different shapes, and BLAS picks its kernel
(its summation order) by shape and by CPU, so they agree to float32 rounding and no
closer. Where the shapes and the code are the same, tests compare exactly instead.

Tokens drawn from such numbers agree up to the first near tie and no further (NEAR_TIE,
below): a comparison of sampled tokens across computations checks every token up to the
first that differs, and that this one is a tie a rounding could tip. Only
`--batch-invariant on` promises seeded tokens bit for bit in any company.

`.ci/run` runs the numeric tests a second time under another kernel choice, so that a
bound that holds only for this CPU's kernels fails in CI rather than on a user's machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

FLOAT32_EPS = float(np.finfo(np.float32).eps)  # 1.2e-7: one ulp at 1.0
LONGEST_REDUCTION = 4096  # the tiny model's vocabulary: the lm_head and log-sum-exp sum it

LOSS_RTOL = 1e-5
"""Losses, relative: eps * sqrt(4096) = 7.6e-6, rounded up (measured: <= 1.1e-7)."""

LOGPROB_ATOL = 1e-5
"""Per-token logprobs, absolute: a log-sum-exp's error is absolute, eps * sqrt(4096)
times logits of order 1 (measured: <= 9.5e-7, 2 ulps at |logprob| ~ 8)."""

STATE_LOGPROB_ATOL = 5e-5
"""Per-token logprobs of a model whose layers carry a state along the sequence (Gated
DeltaNet, Mamba), absolute: each state is a running sum over the datum's earlier tokens,
so its rounding grows with the datum's length T and the number of such layers L, not with
the vocabulary: eps * T * L = 1.2e-7 * 64 * 3 = 2.3e-5 for the tiny hybrids, rounded up
(measured: <= 1.5e-5 under `ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE`). A state
that leaked from one datum into the next moved logprobs by 7e-2."""

GRAD_RTOL = 1e-4
"""Gradients, relative to the tensor's largest element: each sums over every token of the
batch through every layer, so its error scales with the largest terms, not with the
element (measured: <= 2.8e-6 on a merged pass's first gradient)."""

STATE_GRAD_RTOL = 1e-3
"""Gradients of a model whose layers carry a state, relative to the tensor's largest
element: backward runs each recurrence the other way over the same T tokens (measured:
<= 1.4e-4 under the generic kernels above); a leaked state or a wrong adapter moves them by
a large part of their size."""

ADAM_DRIFT = 1e-2
"""Weights after N AdamW steps at learning rate lr agree within ADAM_DRIFT * lr * N. Adam
divides each element's gradient by its own running size, so an element whose gradient
nearly cancels turns rounding into a visible step: measured up to 1.0e-3 * lr * N over 3
steps and four kernel choices. A real difference is far above: weighting one of 24
tokens' loss by 0.999 instead of 1 moves some weight by 0.7 * lr * N."""


def adam_drift_bound(learning_rate: float, steps: int) -> float:
    """The most two AdamW runs of `steps` steps may differ by in any one weight."""
    return ADAM_DRIFT * learning_rate * steps


def max_abs_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> float:
    """The largest |a[k] - b[k]| over the tensors (torch or numpy) of two same-keyed maps."""
    assert sorted(a) == sorted(b)
    return max(float(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)).max())
               for k in a)


def assert_trained_alike(got: Mapping[str, Any], want: Mapping[str, Any],
                         learning_rate: float, steps: int) -> None:
    """Two adapters' weights after `steps` AdamW steps agree within `adam_drift_bound`."""
    bound = adam_drift_bound(learning_rate, steps)
    diff = max_abs_diff(got, want)
    assert diff <= bound, f"weights differ by {diff:.3g}, over {ADAM_DRIFT} * lr * steps = {bound:.3g}"


def assert_grads_close(got, want, rtol: float = GRAD_RTOL) -> None:
    """Two gradients agree within `rtol` (GRAD_RTOL, or STATE_GRAD_RTOL for a model with
    stateful layers) of the reference's largest element."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = float(np.abs(want).max())
    diff = float(np.abs(got - want).max())
    assert diff <= rtol * scale, (f"gradients differ by {diff:.3g}, over {rtol} "
                                  f"of their largest element {scale:.3g}")


# ---------------------------------------------------------------- tokens drawn from them

NEAR_TIE = 2 * LOGPROB_ATOL
"""How close a choice between two tokens may be and still go either way in two
computations of one request (alone and in company, pool and static batch, prefix-cache
hit and miss, two kernels). Their logprobs agree within LOGPROB_ATOL, so:

* greedy: B's top two are within LOGPROB_ATOL of A's each, so the argmax can change only
  where A's top two are within 2 * LOGPROB_ATOL;
* a seeded draw (`engine/sampling/tokens.py`: the first token, in id order, whose
  cumulative probability passes the draw's uniform number u): every probability is within
  a factor exp(+-LOGPROB_ATOL) of A's, so each cumulative sum c <= 1 moves by at most
  LOGPROB_ATOL * c and u's scale (the sum of all) by LOGPROB_ATOL * u: the token can change
  only where u lies within 2 * LOGPROB_ATOL of a cumulative boundary.

Measured (a 2-row request of 200 tokens alone in the static batch and in the decode pool,
AMD EPYC, native kernels and ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE): logprobs
differ by at most 8.3e-7 and cumulative sums by 3.0e-7, 70x below NEAR_TIE.

Such ties are not rare where a distribution is flat: the tiny model gives each of its
4096 tokens about 1/4096, so u lands within 3e-7 of a boundary on about one draw in a
thousand, and a long sample goes the other way somewhere (token 114 of 200: 3109 alone,
3110 in the pool, u 6e-8 from their boundary). So a comparison of seeded tokens across
computations checks every token up to the first that differs, and that one must be a
near tie: a token the reference could have drawn within NEAR_TIE (`drawable`). Past it
the two go on from different tokens, and nothing more is compared. Only
`--batch-invariant on` promises the same tokens bit for bit."""


def _kept(logprobs: np.ndarray, temperature: float, top_k: int, top_p: float
          ) -> tuple[np.ndarray, bool]:
    """`tokens.pick`'s kept set (top-k, then top-p of the tempered distribution) as a bool
    mask over `[V]`, and whether its edge is a near tie (a token in or out by rounding)."""
    vocab = logprobs.size
    order = np.argsort(-logprobs, kind="stable")
    keep = np.ones(vocab, bool)
    edge = False
    if 0 < top_k < vocab:
        keep[order[top_k:]] = False
        edge = logprobs[order[top_k - 1]] - logprobs[order[top_k]] <= NEAR_TIE
        order = order[:top_k]
    if top_p < 1.0:
        scores = logprobs[order] / temperature
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        drop = before >= top_p
        drop[0] = False
        keep[order[drop]] = False
        edge = edge or bool((np.abs(before[1:] - top_p) <= NEAR_TIE).any())
    return keep, edge


def drawable(logprobs: np.ndarray, uniform: float | None, *, temperature: float = 1.0,
             top_k: int = -1, top_p: float = 1.0) -> np.ndarray:
    """The tokens (a bool mask over `[V]`) that a draw could pick from logprobs within
    LOGPROB_ATOL of `logprobs` (`[V]`, untempered, by token id) with the same `uniform`
    number (None: greedy), under the request's parameters: the reference's own pick, and
    any other within NEAR_TIE of it."""
    logprobs = np.asarray(logprobs, np.float64)
    if uniform is None or temperature == 0 or top_k == 1:
        return logprobs >= logprobs.max() - NEAR_TIE
    keep, edge = _kept(logprobs, temperature, top_k, top_p)
    if edge:
        # A token in or out of the kept set moves every boundary by its share: any token
        # may then be drawn. (Rare: the edge's two logprobs within 2e-5.)
        return np.ones(logprobs.size, bool)
    scores = logprobs / temperature
    probs = np.where(keep, np.exp(scores - scores[keep].max()), 0.0)
    probs /= probs.sum()
    cdf = np.cumsum(probs)   # in id order, as the draw walks them
    return keep & (cdf - probs - NEAR_TIE <= uniform) & (uniform < cdf + NEAR_TIE)


def assert_alike_until_a_near_tie(reference, got, could_draw, what: str = "",
                                  upto: int | None = None) -> int:
    """One sampled row computed twice (`reference`, `got`: each with `tokens`, `logprobs`
    and `stop_reason`) agrees: the same tokens up to the first that differs, which must be
    one the reference could have drawn by a near tie (`could_draw(step, token)`, e.g. from
    `drawable`); logprobs within LOGPROB_ATOL up to there; with no such token, the same
    length and stop reason. Only the first `upto` tokens are compared when given (where
    the draws' numbers may part after: `tests/engine/draws.py`). Returns how many tokens
    agree."""
    a, b = [int(t) for t in reference.tokens], [int(t) for t in got.tokens]
    end = min(len(a), len(b)) if upto is None else min(len(a), len(b), upto)
    same = next((i for i in range(end) if a[i] != b[i]), end)
    np.testing.assert_allclose(np.asarray(got.logprobs[:same], np.float64),
                               np.asarray(reference.logprobs[:same], np.float64),
                               rtol=0, atol=LOGPROB_ATOL, err_msg=what)
    if same < end:
        assert could_draw(same, b[same]), (
            f"{what}: token {same} is {b[same]}, the reference's {a[same]}, and no near tie "
            f"(within {NEAR_TIE}) lets a draw pick it")
    elif upto is None or upto >= min(len(a), len(b)):
        assert (len(a), reference.stop_reason) == (len(b), got.stop_reason), what
    return same


def assert_rows_alike(reference, got, could_draw, what: str = "",
                      draws_numbers: bool = True) -> list[int]:
    """A request's rows computed twice agree row by row up to the first near tie that
    went the other way (`assert_alike_until_a_near_tie`; `could_draw(row)` gives a row's
    predicate). Returns how many tokens of each row agree.

    The rows of a seeded request draw their numbers together, one call a step for the
    rows still going: once a row stops at another step in one run than in the other,
    every row's numbers may differ from there, so all are compared up to that step only
    (`draws_numbers` False, greedy: no numbers, no such step)."""
    assert len(got) == len(reference), what
    pairs = list(zip(reference, got, strict=True))
    horizon = min((min(len(a.tokens), len(b.tokens)) for a, b in pairs
                   if len(a.tokens) != len(b.tokens)), default=None)
    return [assert_alike_until_a_near_tie(a, b, could_draw(row), f"{what} row {row}",
                                          upto=horizon if draws_numbers else None)
            for row, (a, b) in enumerate(pairs)]


def greedy_could_draw(top_ids, top_logprobs):
    """`could_draw` for a greedy reference sampled with its top k >= 2 at each step (the
    SDK's `topk_sample_logprobs`): a token within NEAR_TIE of the best, or any token
    beyond the top k when even the k-th is."""
    def could(step: int, token: int) -> bool:
        ids = [int(i) for i in top_ids[step]]
        logprobs = np.asarray(top_logprobs[step], np.float64)
        assert logprobs.size >= 2, "ask for the top 2 at least"
        floor = logprobs.max() - NEAR_TIE
        return bool(logprobs[ids.index(token)] >= floor if token in ids
                    else logprobs.min() >= floor)
    return could



def topk_greedy_could_draw(sequence):
    """`greedy_could_draw` of a greedy reference sequence sampled with its top k >= 2:
    the engine's (`topk_token_ids`, `topk_logprobs` arrays) or an SDK's (`topk_logprobs`,
    per step a list of (token, logprob))."""
    if getattr(sequence, "topk_token_ids", None) is not None:
        return greedy_could_draw(sequence.topk_token_ids, sequence.topk_logprobs)
    steps = sequence.topk_logprobs
    assert steps is not None, "sample the reference with its top 2 (topk_sample_logprobs)"
    return greedy_could_draw([[t for t, _ in step] for step in steps],
                             [[lp for _, lp in step] for step in steps])

def assert_topk_alike(ids, logprobs, reference) -> None:
    """A top-k list (`ids`, `logprobs`: `[..., k]`) computed another way than `reference`
    (logprobs `[..., V]`) agrees with it: the listed logprobs are the reference's k
    largest within LOGPROB_ATOL, and each listed token has its listed logprob in the
    reference. Two tokens a rounding apart may trade places (or the k-th place), so the
    ids are not compared one by one."""
    ids = np.asarray(ids, np.int64)
    logprobs = np.asarray(logprobs, np.float64)
    reference = np.asarray(reference, np.float64)
    best = -np.sort(-reference, axis=-1)[..., :ids.shape[-1]]
    np.testing.assert_allclose(logprobs, best, rtol=0, atol=LOGPROB_ATOL)
    np.testing.assert_allclose(np.take_along_axis(reference, ids, -1), logprobs, rtol=0,
                               atol=LOGPROB_ATOL)


def assert_argmax_alike(tokens, reference) -> None:
    """Tokens chosen as the argmax of logprobs computed another way than `reference`
    (`[..., V]`; `tokens` `[...]` or `[..., n]`) are the reference's argmax up to a near
    tie: each within NEAR_TIE of the reference's largest."""
    reference = np.asarray(reference, np.float64)
    tokens = np.asarray(tokens, np.int64)
    if tokens.ndim == reference.ndim - 1:
        tokens = tokens[..., None]
    chosen = np.take_along_axis(reference, tokens, -1)
    gap = reference.max(-1, keepdims=True) - chosen
    assert (gap <= NEAR_TIE).all(), f"argmax off by up to {gap.max():.3g}, over {NEAR_TIE}"


def neighbours_could_draw(reference_tokens, score):
    """`could_draw` for a plain seeded draw (temperature 1, no top-k or top-p) whose
    reference is known by its tokens only (through an SDK): token b may replace the
    reference's a at a step only if they are neighbours in the draw's walk (by token id),
    no token between them holding NEAR_TIE of probability there. A draw that differs by
    rounding passes a boundary by less than that; a draw from other numbers lands
    anywhere. `score(prefix, token)` is the logprob of `token` after the reference's first
    `prefix` tokens (e.g. `compute_logprobs` of the prompt, those tokens and `token`)."""
    def could(step: int, token: int) -> bool:
        ours = int(reference_tokens[step])
        between = range(min(ours, token) + 1, max(ours, token))
        prefix = [int(t) for t in reference_tokens[:step]]
        return all(np.exp(score(prefix, t)) <= NEAR_TIE for t in between)
    return could


def sdk_score(sampler, prompt):
    """`neighbours_could_draw`'s score through a Tinker sampling client (the stock SDK's
    or the shim's): a token's logprob after `prompt` (token ids) and a prefix."""
    from tinker import types

    def score(prefix: list[int], token: int) -> float:
        ids = types.ModelInput.from_ints([int(t) for t in prompt] + list(prefix) + [token])
        return sampler.compute_logprobs(ids).result()[-1]
    return score
