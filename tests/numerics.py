"""Tolerances for numbers that two different computations must agree on.

They are the isolation contract's (top of `twinkle_server/engine/engine.py`): a merged
pass against a pass alone, padded against unpadded, the server against the engine, the
engine against PEFT. Such pairs run GEMMs of different shapes, and BLAS picks its kernel
(its summation order) by shape and by CPU, so they agree to float32 rounding and no
closer. Where the shapes and the code are the same, tests compare exactly instead.

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

GRAD_RTOL = 1e-4
"""Gradients, relative to the tensor's largest element: each sums over every token of the
batch through every layer, so its error scales with the largest terms, not with the
element (measured: <= 2.8e-6 on a merged pass's first gradient)."""

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


def assert_grads_close(got, want) -> None:
    """Two gradients agree within GRAD_RTOL of the reference's largest element."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = float(np.abs(want).max())
    diff = float(np.abs(got - want).max())
    assert diff <= GRAD_RTOL * scale, (f"gradients differ by {diff:.3g}, over {GRAD_RTOL} "
                                       f"of their largest element {scale:.3g}")
