"""Advantage estimators for RL on the client: rewards in, one advantage per completion out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from twinkle_client.errors import require_int

AdvantageScale = Literal["group", "batch", "none"]
SCALES: tuple[str, ...] = ("group", "batch", "none")


class GRPOAdvantage:
    """Group-relative advantages (GRPO): each reward minus its group's mean, scaled.

    A group is `num_generations` CONSECUTIVE rewards, the completions of one prompt, so
    sample as `[p for p in prompts for _ in range(n)]`. With `scale`:

    - `'group'`: `(r - mean_group) / (std_group + eps)`,
    - `'batch'`: `(r - mean_group) / (std_batch + eps)`,
    - `'none'`: `r - mean_group`.

    std is the sample standard deviation (ddof=1, as TRL's GRPO). A group whose rewards are
    all equal gets exactly zero advantages (it carries no signal).

    Args:
        eps: added to the std so a tiny spread does not blow up.

    Example:
        >>> GRPOAdvantage()([1.0, 0.0, 2.0, 2.0], num_generations=2).round(3).tolist()
        [0.707, -0.707, 0.0, 0.0]
    """

    def __init__(self, eps: float = 1e-4) -> None:
        if not eps >= 0:
            raise ValueError(f"eps: must be >= 0, got {eps}")
        self.eps = eps

    def __call__(self, rewards: Sequence[float] | np.ndarray, num_generations: int,
                 scale: AdvantageScale = "group") -> np.ndarray:
        """Float64 advantages, one per reward, in the rewards' order.

        Raises:
            ValueError: `num_generations` < 1 or not dividing the number of rewards, a
                reward that is not finite, or an unknown `scale`.
        """
        if scale not in SCALES:
            raise ValueError(f"scale: {scale!r} is not one of {list(SCALES)}")
        require_int(num_generations, "num_generations")
        values = np.asarray(rewards, dtype=np.float64)
        if values.ndim != 1:
            raise ValueError(f"rewards: must be 1-D, got shape {list(values.shape)}")
        if values.size % num_generations:
            raise ValueError(f"rewards: {values.size} rewards do not split into groups of "
                             f"num_generations={num_generations}")
        if not np.all(np.isfinite(values)):
            raise ValueError(f"rewards: must be finite, found {values[~np.isfinite(values)][0]}")
        groups = values.reshape(-1, num_generations)
        centred = groups - groups.mean(axis=1, keepdims=True)
        if scale == "group":
            spread = groups.std(axis=1, ddof=1, keepdims=True) if num_generations > 1 else 0.0
            centred = centred / (spread + self.eps)
        elif scale == "batch":
            spread = values.std(ddof=1) if values.size > 1 else 0.0
            centred = centred / (spread + self.eps)
        flat = groups.max(axis=1) == groups.min(axis=1)
        centred[flat] = 0.0
        return centred.reshape(-1)
