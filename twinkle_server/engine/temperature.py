"""Logits over a temperature, the one way the sampler and prompt scoring divide by one.

Each row is shifted by its largest logit first, so every score is at most 0 and none is
NaN: divided unshifted, a temperature of 2.5e-39 overflowed the scores to inf, and the
softmax of those to NaN. The temperature is held within the dtype's normal range: below
its smallest normal number (1.2e-38 in float32) it counts as that number, where only the
largest logits keep any probability (the limit of a vanishing temperature); above its
largest it counts as that, where -inf stays -inf (-inf over inf would be NaN).
"""

from __future__ import annotations

import torch


def tempered(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Finite-topped `logits` `[n, V]` (each row's largest finite) over `temperature` (a
    number, or `[n, 1]`), less each row's largest: at most 0, never NaN."""
    info = torch.finfo(logits.dtype)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.clamp(info.tiny, info.max)
    else:
        temperature = min(max(temperature, info.tiny), info.max)
    return (logits - logits.amax(-1, keepdim=True)) / temperature
