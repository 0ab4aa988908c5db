"""Loss functions over per-token target logprobs, with Tinker's exact semantics.

Tinker losses are plain sums over tokens, with no hidden normalisation (`logp` is the
logprob of each target token, `ratio = exp(logp - old_logp)`, `A` the advantages):

    cross_entropy        = -(logp * weights).sum()
    importance_sampling  = -(ratio * A).sum()
    ppo                  = -min(ratio * A, clamp(ratio, lo, hi) * A).sum()     lo/hi 0.8/1.2
    cispo                = -(clamp(ratio, lo, hi).detach() * logp * A).sum()   lo/hi 0.0/4.0
    dro                  = -(logp * A - 0.5 * beta * (logp - old_logp)**2).sum()   beta 1.0

The native client's losses normalise, and divide by the number of gradient-accumulation
micro-batches so k equal micro-batches add up to one big batch:

    CrossEntropyLoss     = -(logp * w).sum() / w.sum()          (token mean over the batch)
    GRPOLoss             = -mean_seq( mean_tok( min(ratio*A, clamp(ratio, 1-eps, 1+eps_high)*A) ) )

Metric keys are `name:reduction`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import Datum, LossSpec


@dataclass(frozen=True)
class _LossDef:
    required: tuple[str, ...]
    config: Mapping[str, float]
    native: bool = False


_RATIO = ("logprobs", "advantages")
LOSSES: dict[str, _LossDef] = {
    "cross_entropy": _LossDef(("target_tokens",), {}),
    "importance_sampling": _LossDef(("target_tokens", *_RATIO), {}),
    "ppo": _LossDef(("target_tokens", *_RATIO),
                    {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": _LossDef(("target_tokens", *_RATIO),
                      {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": _LossDef(("target_tokens", *_RATIO), {"beta": 1.0}),
    "CrossEntropyLoss": _LossDef(("target_tokens",), {}, native=True),
    "GRPOLoss": _LossDef(("target_tokens", *_RATIO), {"epsilon": 0.2, "epsilon_high": -1.0},
                         native=True),
}
LOSS_NAMES = frozenset(LOSSES)
_FLOAT_INPUTS = ("weights", "logprobs", "advantages")


def resolve_config(spec: LossSpec) -> dict[str, float]:
    """The loss's config with defaults filled in; unknown keys and non-finite values rejected."""
    if spec.name not in LOSSES:
        raise InvalidArgument(
            f"loss_fn: unknown loss {spec.name!r}; valid losses are {sorted(LOSS_NAMES)}")
    known = LOSSES[spec.name].config
    for key, value in spec.config.items():
        if key not in known:
            raise InvalidArgument(
                f"loss_fn_config: {key!r} is not a parameter of {spec.name} "
                f"(it takes {sorted(known) or 'no parameters'})")
        if not math.isfinite(float(value)):
            raise InvalidArgument(f"loss_fn_config.{key}: must be finite, got {value}")
    config = {**known, **{k: float(v) for k, v in spec.config.items()}}
    if spec.name == "GRPOLoss" and config["epsilon_high"] < 0:
        config["epsilon_high"] = config["epsilon"]
    return config


def validate_loss(spec: LossSpec, datums: Sequence[Datum]) -> None:
    """Check the loss name, its config and every datum's loss inputs before any compute."""
    resolve_config(spec)
    required = LOSSES[spec.name].required
    for index, datum in enumerate(datums):
        inputs = datum.loss_inputs
        for key in required:
            if key not in inputs:
                raise InvalidArgument(
                    f"datum[{index}].loss_fn_inputs: {spec.name} needs {key!r} "
                    f"(it needs {list(required)})")
        shape = inputs["target_tokens"].shape
        for key in _FLOAT_INPUTS:
            if key not in inputs:
                continue
            value = inputs[key]
            if value.shape != shape:
                raise InvalidArgument(
                    f"datum[{index}].loss_fn_inputs[{key!r}]: shape {list(value.shape)} "
                    f"differs from target_tokens' {list(shape)}")
            if not np.all(np.isfinite(value)):
                raise InvalidArgument(
                    f"datum[{index}].loss_fn_inputs[{key!r}]: contains NaN or infinity")


def compute_loss(spec: LossSpec, logprobs: Sequence[torch.Tensor],
                 inputs: Sequence[Mapping[str, torch.Tensor]],
                 num_micro_batches: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss to backpropagate and its metrics, for one request's datums.

    `logprobs[i]` has the shape of `inputs[i]['target_tokens']`. Only the native losses
    divide by `num_micro_batches`; Tinker losses are plain sums.
    """
    config = resolve_config(spec)
    logp = torch.cat([lp.reshape(-1) for lp in logprobs])
    weights = _cat(inputs, "weights", logp, default=1.0)
    metrics: dict[str, float] = {"tokens:sum": float((weights != 0).sum())}
    name = spec.name
    if name in ("cross_entropy", "CrossEntropyLoss"):
        total = -(logp * weights).sum()
        if name == "cross_entropy":
            loss = total
        else:
            denom = weights.sum()
            loss = total / denom if float(denom) != 0 else total * 0.0
            loss = loss / num_micro_batches
        return _finish(loss, name, metrics)
    old = _cat(inputs, "logprobs", logp)
    adv = _cat(inputs, "advantages", logp)
    ratio = torch.exp(logp - old)
    active = weights != 0
    metrics["ratio:mean"] = float(ratio.detach()[active].mean()) if active.any() else 1.0
    if name == "importance_sampling":
        loss = -(ratio * adv).sum()
    elif name == "ppo":
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        clipped = torch.clamp(ratio, lo, hi)
        loss = -torch.minimum(ratio * adv, clipped * adv).sum()
        metrics["clip_fraction:mean"] = _clip_fraction(ratio, lo, hi, active)
    elif name == "cispo":
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        loss = -(torch.clamp(ratio, lo, hi).detach() * logp * adv).sum()
        metrics["clip_fraction:mean"] = _clip_fraction(ratio, lo, hi, active)
    elif name == "dro":
        loss = -(logp * adv - 0.5 * config["beta"] * (logp - old) ** 2).sum()
    else:  # GRPOLoss
        lo, hi = 1.0 - config["epsilon"], 1.0 + config["epsilon_high"]
        per_token = torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        loss = -_sequence_mean(per_token, [lp.numel() for lp in logprobs], active)
        loss = loss / num_micro_batches
        metrics["clip_fraction:mean"] = _clip_fraction(ratio, lo, hi, active)
    return _finish(loss, name, metrics)


def _cat(inputs: Sequence[Mapping[str, torch.Tensor]], key: str, like: torch.Tensor,
         default: float | None = None) -> torch.Tensor:
    parts = []
    for item in inputs:
        if key in item:
            parts.append(item[key].reshape(-1).to(like.dtype))
        else:
            parts.append(torch.full((item["target_tokens"].numel(),), float(default),
                                    dtype=like.dtype, device=like.device))
    return torch.cat(parts) if parts else like.new_zeros(0)


def _clip_fraction(ratio: torch.Tensor, lo: float, hi: float, active: torch.Tensor) -> float:
    if not active.any():
        return 0.0
    r = ratio.detach()[active]
    return float(((r < lo) | (r > hi)).float().mean())


def _sequence_mean(per_token: torch.Tensor, lengths: list[int], active: torch.Tensor
                   ) -> torch.Tensor:
    means = []
    for piece, mask in zip(per_token.split(lengths), active.split(lengths), strict=True):
        count = mask.sum()
        if count > 0:
            means.append((piece * mask).sum() / count)
    return torch.stack(means).mean() if means else per_token.sum() * 0.0


def _finish(loss: torch.Tensor, name: str, metrics: dict[str, float]
            ) -> tuple[torch.Tensor, dict[str, float]]:
    key = "loss:mean" if LOSSES[name].native else "loss:sum"
    metrics[key] = float(loss.detach())
    return loss, metrics
