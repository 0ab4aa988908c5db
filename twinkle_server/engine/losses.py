"""Loss functions over per-token target logprobs, with Tinker's exact semantics.

Tinker losses are plain sums over tokens, with no hidden normalisation (`logp` is the
logprob of each target token, `ratio = exp(logp - old_logp)`, `A` the advantages):

    cross_entropy        = -(logp * weights).sum()                              weights default 1
    importance_sampling  = -(ratio * A).sum()
    ppo                  = -min(ratio * A, clamp(ratio, lo, hi) * A).sum()     lo/hi 0.8/1.2
    cispo                = -(clamp(ratio, lo, hi).detach() * logp * A).sum()   lo/hi 0.0/4.0
    dro                  = -(logp * A - 0.5 * beta * (logp - old_logp)**2).sum()   beta 1.0

`lo`/`hi` are the config keys `clip_low_threshold`/`clip_high_threshold`. The installed
`tinker` SDK names `beta` only as a config key and ships no default, so ours is 1.0.

The native client's losses normalise, and divide by the number of gradient-accumulation
micro-batches (`num_micro_batches`) so that k micro-batches of equal total weight add up
to the gradient of one big batch. Only these two use `num_micro_batches`:

    CrossEntropyLoss     = -(logp * w).sum() / w.sum()                 (0 when w.sum() == 0)
    GRPOLoss             = -mean_seq( mean_{tok: w > 0}( min(ratio*A, clamp(ratio, 1-eps, 1+eps_high)*A) ) )

with `epsilon` 0.2 and `epsilon_high` defaulting to `epsilon`; a sequence with no token of
positive weight is left out of the sequence mean.

Metric keys are `name:reduction`: `loss:sum` (Tinker) or `loss:mean` (native),
`tokens:sum` (positions with non-zero weight), and for the ratio losses `ratio:mean` and
`clip_fraction:mean` over those positions (0.0 for losses that do not clip).
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
    """A loss's required inputs, its config keys with defaults (None: derived), and whether
    it is a native (normalised, micro-batch-divided) loss."""

    required: tuple[str, ...]
    config: Mapping[str, float | None]
    native: bool = False


_RATIO = ("logprobs", "advantages")
_CLIP = ("clip_low_threshold", "clip_high_threshold")
LOSSES: dict[str, _LossDef] = {
    "cross_entropy": _LossDef(("target_tokens",), {}),
    "importance_sampling": _LossDef(("target_tokens", *_RATIO), {}),
    "ppo": _LossDef(("target_tokens", *_RATIO), dict(zip(_CLIP, (0.8, 1.2), strict=True))),
    "cispo": _LossDef(("target_tokens", *_RATIO), dict(zip(_CLIP, (0.0, 4.0), strict=True))),
    "dro": _LossDef(("target_tokens", *_RATIO), {"beta": 1.0}),
    "CrossEntropyLoss": _LossDef(("target_tokens",), {}, native=True),
    # epsilon_high None means "same as epsilon" (symmetric clip), as in the GRPO paper.
    "GRPOLoss": _LossDef(("target_tokens", *_RATIO), {"epsilon": 0.2, "epsilon_high": None},
                         native=True),
}
LOSS_NAMES: frozenset[str] = frozenset(LOSSES)
_FLOAT_INPUTS = ("weights", "logprobs", "advantages")
_NON_NEGATIVE = ("clip_low_threshold", "beta", "epsilon", "epsilon_high")


def resolve_config(spec: LossSpec) -> dict[str, float]:
    """The loss's config with defaults filled in.

    Raises InvalidArgument for an unknown loss, an unknown key, a value that is not a
    finite number, a negative threshold/beta/epsilon, or clip_low > clip_high.
    """
    if spec.name not in LOSSES:
        raise InvalidArgument(
            f"loss_fn: unknown loss {spec.name!r}; valid losses are {sorted(LOSS_NAMES)}")
    known = LOSSES[spec.name].config
    given: dict[str, float] = {}
    for key, value in spec.config.items():
        if key not in known:
            raise InvalidArgument(
                f"loss_fn_config: {key!r} is not a parameter of {spec.name} "
                f"(it takes {sorted(known) or 'no parameters'})")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise InvalidArgument(
                f"loss_fn_config.{key}: must be a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(float(value)):
            raise InvalidArgument(f"loss_fn_config.{key}: must be finite, got {value}")
        if key in _NON_NEGATIVE and value < 0:
            raise InvalidArgument(f"loss_fn_config.{key}: must be >= 0, got {value}")
        given[key] = float(value)
    config = {**known, **given}
    if spec.name == "GRPOLoss" and config["epsilon_high"] is None:
        config["epsilon_high"] = config["epsilon"]
    if _CLIP[0] in config and config[_CLIP[0]] > config[_CLIP[1]]:
        raise InvalidArgument(
            f"loss_fn_config: clip_low_threshold {config[_CLIP[0]]} is above "
            f"clip_high_threshold {config[_CLIP[1]]}")
    return {k: float(v) for k, v in config.items()}  # type: ignore[arg-type]


def validate_loss(spec: LossSpec, datums: Sequence[Datum]) -> None:
    """Check the loss name, its config and every datum's loss inputs before any compute.

    Each error names the datum index and the field: a missing required input, a float
    input whose shape differs from `target_tokens` (both shapes given), or a NaN/infinity.
    """
    resolve_config(spec)
    required = LOSSES[spec.name].required
    for index, datum in enumerate(datums):
        inputs = datum.loss_inputs
        for key in required:
            if key not in inputs:
                raise InvalidArgument(
                    f"datum[{index}].loss_fn_inputs: {spec.name} needs {key!r} "
                    f"(it needs {list(required)})")
        targets = inputs["target_tokens"]
        if targets.ndim not in (1, 2) or not np.issubdtype(targets.dtype, np.integer):
            raise InvalidArgument(
                f"datum[{index}].loss_fn_inputs['target_tokens']: must be integer [T] or "
                f"[T, K], got {targets.dtype} with shape {list(targets.shape)}")
        shape = targets.shape
        for key in _FLOAT_INPUTS:
            if key not in inputs:
                continue
            value = inputs[key]
            if value.shape != shape:
                raise InvalidArgument(
                    f"datum[{index}].loss_fn_inputs[{key!r}]: shape {list(value.shape)} "
                    f"differs from target_tokens' {list(shape)}")
            if not np.issubdtype(value.dtype, np.number):
                raise InvalidArgument(
                    f"datum[{index}].loss_fn_inputs[{key!r}]: must be numeric, got {value.dtype}")
            if not np.all(np.isfinite(value)):
                raise InvalidArgument(
                    f"datum[{index}].loss_fn_inputs[{key!r}]: contains NaN or infinity")


def compute_loss(spec: LossSpec, logprobs: Sequence[torch.Tensor],
                 inputs: Sequence[Mapping[str, torch.Tensor]],
                 num_micro_batches: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar loss to backpropagate and its metrics, for one request's datums.

    `logprobs[i]` is log p(target) with the shape of `inputs[i]['target_tokens']`; inputs
    are assumed checked by `validate_loss`. Only the native losses divide by
    `num_micro_batches` (the adapter's gradient-accumulation count); Tinker losses are
    plain sums whatever it is.
    """
    config = resolve_config(spec)
    if not logprobs or len(logprobs) != len(inputs):
        raise InvalidArgument(
            f"logprobs: need one tensor per datum and at least one datum, got "
            f"{len(logprobs)} logprob tensors for {len(inputs)} datums")
    if isinstance(num_micro_batches, bool) or int(num_micro_batches) != num_micro_batches \
            or num_micro_batches < 1:
        raise InvalidArgument(f"num_micro_batches: must be an integer >= 1, got "
                              f"{num_micro_batches!r}")
    for index, (lp, item) in enumerate(zip(logprobs, inputs, strict=True)):
        if lp.shape != item["target_tokens"].shape:
            raise InvalidArgument(
                f"datum[{index}]: logprobs shape {list(lp.shape)} differs from "
                f"target_tokens' {list(item['target_tokens'].shape)}")
    logp = torch.cat([lp.reshape(-1) for lp in logprobs])
    weights = _cat(inputs, "weights", logp, default=1.0)
    active = weights != 0
    metrics: dict[str, float] = {"tokens:sum": float(active.sum())}
    name = spec.name
    if name in ("cross_entropy", "CrossEntropyLoss"):
        total = -(logp * weights).sum()
        if name == "cross_entropy":
            loss = total
        else:
            denom = weights.sum()
            # No weighted token: 0 (still attached to the graph), never 0/0 = NaN.
            loss = total / denom if float(denom) != 0 else total * 0.0
            loss = loss / num_micro_batches
        return _finish(loss, name, metrics)
    old = _cat(inputs, "logprobs", logp)
    adv = _cat(inputs, "advantages", logp)
    ratio = torch.exp(logp - old)
    metrics["ratio:mean"] = float(ratio.detach()[active].mean()) if active.any() else 1.0
    metrics["clip_fraction:mean"] = 0.0
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
        positive = weights > 0
        loss = -_sequence_mean(per_token, [lp.numel() for lp in logprobs], positive)
        loss = loss / num_micro_batches
        metrics["clip_fraction:mean"] = _clip_fraction(ratio, lo, hi, active)
    return _finish(loss, name, metrics)


def _cat(inputs: Sequence[Mapping[str, torch.Tensor]], key: str, like: torch.Tensor,
         default: float | None = None) -> torch.Tensor:
    """One input field of every datum, flattened and concatenated in `like`'s dtype/device;
    a datum without the field gets `default` everywhere."""
    parts = []
    for item in inputs:
        if key in item:
            parts.append(item[key].reshape(-1).to(device=like.device, dtype=like.dtype))
        else:
            parts.append(torch.full((item["target_tokens"].numel(),), float(default),
                                    dtype=like.dtype, device=like.device))
    return torch.cat(parts)


def _clip_fraction(ratio: torch.Tensor, lo: float, hi: float, active: torch.Tensor) -> float:
    """Share of active positions whose ratio lies outside [lo, hi]."""
    if not active.any():
        return 0.0
    r = ratio.detach()[active]
    return float(((r < lo) | (r > hi)).float().mean())


def _sequence_mean(per_token: torch.Tensor, lengths: list[int], mask: torch.Tensor
                   ) -> torch.Tensor:
    """Mean over each sequence's masked tokens, then over the sequences that have any."""
    means = []
    for piece, keep in zip(per_token.split(lengths), mask.split(lengths), strict=True):
        count = keep.sum()
        if count > 0:
            # where, not multiply: 0 * inf on a masked position would be NaN.
            means.append(torch.where(keep, piece, 0.0).sum() / count)
    return torch.stack(means).mean() if means else per_token.sum() * 0.0


def _finish(loss: torch.Tensor, name: str, metrics: dict[str, float]
            ) -> tuple[torch.Tensor, dict[str, float]]:
    key = "loss:mean" if LOSSES[name].native else "loss:sum"
    metrics[key] = float(loss.detach())
    return loss, metrics
