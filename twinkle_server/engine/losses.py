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

`gspo` is GSPO-token as Tinker documents it. Per datum, over the positions M that its
`sequence_ratio_mask` marks (non-zero; a datum whose mask marks none is refused, since the
mean over no token is undefined), with `sg` the stop-gradient:

    s    = exp(mean_{t in M}(sg(logp_t) - old_logp_t))           the sequence ratio
    s_t  = sg(s) * exp(logp_t - sg(logp_t))                       s's value, logp_t's gradient
    gspo = -sum_t min(s_t * A_t, clamp(s_t, lo, hi) * A_t)        lo/hi 0.8/1.2

summed over every position of every datum (the prompt's zero advantages add nothing).
The stored copy of Tinker's GSPO page ends before it states defaults, so `lo`/`hi` take
`ppo`'s. A datum without `sequence_ratio_mask` takes M = its positions with non-zero
advantage: tinker-cookbook 0.6.1's `rl.train` sends gspo datums with no mask, and the
mask its `recipes/rl_loop.py` sends marks the sampled tokens, which are exactly the
positions carrying its advantage. If that M is empty every A_t is 0, so the datum adds 0
to the loss and the gradient whatever s is; s is then taken as 1.

`stable_reinforce` is Tinker's StableReinforce (alpha). Its inputs are resolved by the
runtime from the sampler's own records (`runtime.stability`), not taken from the client:
`logprobs` are the sampler's float32 logprobs of the sampled tokens (q_t) and
`sampled_mask` marks the positions S whose target is a sampled token (the rest are
prompt tokens, which must carry zero advantage). Tinker's page states the inputs and the
`kl_coeff` key but not the objective; ours is truncated-importance-weighted REINFORCE
with an optional penalty pulling the policy toward the sampler, both only over S:

    rho_t            = exp(logp_t - q_t)
    stable_reinforce = sum_{t in S} ( -sg(min(rho_t, C)) * A_t * logp_t
                                      + kl_coeff * (rho_t - 1 - log(rho_t)) )

with `C` the key `clip_high_threshold` (default 2.0, the truncation of "truncated importance
sampling") and `kl_coeff` 0.0. `rho - 1 - log(rho)` is the non-negative, unbiased (under
tokens drawn from q) estimate of KL(q || p); its gradient is `(rho_t - 1) * grad logp_t`.
On-policy (`rho` = 1) the gradient is REINFORCE's, `-A_t * grad logp_t`.

The native client's losses normalise, and divide by the number of gradient-accumulation
micro-batches (`num_micro_batches`) so that k micro-batches of equal total weight add up
to the gradient of one big batch. Only these two use `num_micro_batches`:

    CrossEntropyLoss     = -(logp * w).sum() / w.sum()                 (0 when w.sum() == 0)
    GRPOLoss             = -mean_seq( mean_{tok: w > 0}( min(ratio*A, clamp(ratio, 1-eps, 1+eps_high)*A) ) )

with `epsilon` 0.2 and `epsilon_high` defaulting to `epsilon`; a sequence with no token of
positive weight is left out of the sequence mean.

Metric keys are `name:reduction`: `loss:sum` (Tinker) or `loss:mean` (native),
`tokens:sum` (positions with non-zero weight), and for the ratio losses `ratio:mean` and
`clip_fraction:mean` over those positions (0.0 for losses that do not clip), or for a
datum without weights over its positions with non-zero advantage (an RL datum's prompt
scores nothing). For
`stable_reinforce` those positions are S, and `kl:mean` is the mean of the KL estimate
over S.
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
    # sequence_ratio_mask is optional: without it, the positions with non-zero advantage.
    "gspo": _LossDef(("target_tokens", *_RATIO), dict(zip(_CLIP, (0.8, 1.2), strict=True))),
    "stable_reinforce": _LossDef(("target_tokens", *_RATIO, "sampled_mask"),
                                 {"kl_coeff": 0.0, "clip_high_threshold": 2.0}),
    "CrossEntropyLoss": _LossDef(("target_tokens",), {}, native=True),
    # epsilon_high None means "same as epsilon" (symmetric clip), as in the GRPO paper.
    "GRPOLoss": _LossDef(("target_tokens", *_RATIO), {"epsilon": 0.2, "epsilon_high": None},
                         native=True),
}
LOSS_NAMES: frozenset[str] = frozenset(LOSSES)
_FLOAT_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask", "sampled_mask")
_OPTIONAL = {"gspo": ("sequence_ratio_mask",)}
"""Inputs a loss reads when given, beyond its required ones and `weights`."""
_NON_NEGATIVE = ("clip_low_threshold", "beta", "epsilon", "epsilon_high", "kl_coeff",
                 "clip_high_threshold")
_ONE_TARGET = ("gspo", "stable_reinforce")
"""Losses that take one target per position (`target_tokens` [T]): their ratios are per
sequence (gspo) or per sampled token (stable_reinforce)."""


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

    Each error names the datum index and the field: a missing required input, an input no
    loss reads (the SDK's per-token `clip_low_threshold`, say: served nowhere, so refused
    rather than ignored), a float input whose shape differs from `target_tokens` (both
    shapes given), or a NaN/infinity.
    """
    resolve_config(spec)
    required = LOSSES[spec.name].required
    reads = sorted({*required, "weights", *_OPTIONAL.get(spec.name, ())})
    for index, datum in enumerate(datums):
        inputs = datum.loss_inputs
        for key in required:
            if key not in inputs:
                raise InvalidArgument(
                    f"datum[{index}].loss_fn_inputs: {spec.name} needs {key!r} "
                    f"(it needs {list(required)})")
        for key in inputs:
            if key != "target_tokens" and key not in _FLOAT_INPUTS:
                hint = " (its clip thresholds are loss_fn_config keys)" if key in _CLIP else ""
                raise InvalidArgument(
                    f"datum[{index}].loss_fn_inputs[{key!r}]: no loss reads it; "
                    f"{spec.name} reads {reads}{hint}")
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
        if spec.name in _ONE_TARGET and targets.ndim != 1:
            raise InvalidArgument(
                f"datum[{index}].loss_fn_inputs['target_tokens']: {spec.name} takes one "
                f"target per position ([T]), got shape {list(shape)}")
        if spec.name == "gspo" and "sequence_ratio_mask" in inputs \
                and not np.any(inputs["sequence_ratio_mask"]):
            raise InvalidArgument(
                f"datum[{index}].loss_fn_inputs['sequence_ratio_mask']: marks no position; "
                "the sequence ratio is a mean over the marked tokens, so mark at least one "
                "(the sampled tokens)")


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
    metrics: dict[str, float] = {"tokens:sum": float((weights != 0).sum())}
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
    scored = _marked(inputs, "weights", logp)
    ratio = torch.exp(logp - old)
    metrics["ratio:mean"] = float(ratio.detach()[scored].mean()) if scored.any() else 1.0
    metrics["clip_fraction:mean"] = 0.0
    if name == "importance_sampling":
        loss = -(ratio * adv).sum()
    elif name == "ppo":
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        clipped = torch.clamp(ratio, lo, hi)
        loss = -torch.minimum(ratio * adv, clipped * adv).sum()
        metrics["clip_fraction:mean"] = _clip_fraction(ratio, lo, hi, scored)
    elif name == "cispo":
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        loss = -(torch.clamp(ratio, lo, hi).detach() * logp * adv).sum()
        metrics["clip_fraction:mean"] = _clip_fraction(ratio, lo, hi, scored)
    elif name == "dro":
        loss = -(logp * adv - 0.5 * config["beta"] * (logp - old) ** 2).sum()
    elif name == "gspo":
        lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
        ratio = _gspo_ratio(logp, old, _marked(inputs, "sequence_ratio_mask", logp),
                            [lp.numel() for lp in logprobs])
        loss = -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()
        metrics["ratio:mean"] = float(ratio.detach()[scored].mean()) if scored.any() else 1.0
        metrics["clip_fraction:mean"] = _clip_fraction(ratio, lo, hi, scored)
    elif name == "stable_reinforce":
        return _stable_reinforce(logp, old, adv, _cat(inputs, "sampled_mask", logp) != 0,
                                 config, metrics)
    else:  # GRPOLoss
        lo, hi = 1.0 - config["epsilon"], 1.0 + config["epsilon_high"]
        per_token = torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
        positive = weights > 0
        loss = -_sequence_mean(per_token, [lp.numel() for lp in logprobs], positive)
        loss = loss / num_micro_batches
        metrics["clip_fraction:mean"] = _clip_fraction(ratio, lo, hi, scored)
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


def _marked(inputs: Sequence[Mapping[str, torch.Tensor]], key: str, like: torch.Tensor
            ) -> torch.Tensor:
    """Each datum's positions where its `key` is non-zero, concatenated on `like`'s
    device, or without `key` its positions with non-zero advantage (what cookbook
    rl_loop's mask marks: an RL datum's prompt carries advantage 0)."""
    return torch.cat([(item[key] if key in item else item["advantages"])
                      .reshape(-1).to(like.device) != 0 for item in inputs])


def _gspo_ratio(logp: torch.Tensor, old: torch.Tensor, mask: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
    """GSPO-token's per-token ratio: each datum's sequence ratio (the mean log-ratio over its
    masked tokens, no gradient) as the value, each token's own logprob as the gradient.
    A datum with no masked token (only an unmasked one whose advantages are all 0, which
    then adds nothing to the loss) gets ratio 1, not the mean of nothing (NaN)."""
    parts = []
    for lp, q, keep in zip(logp.split(lengths), old.split(lengths), mask.split(lengths),
                           strict=True):
        log_ratio = (lp.detach() - q)[keep].mean() if keep.any() else lp.new_zeros(())
        parts.append(torch.exp(log_ratio + lp - lp.detach()))
    return torch.cat(parts)


def _stable_reinforce(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                      sampled: torch.Tensor, config: Mapping[str, float],
                      metrics: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """See the module docstring: truncated-IS REINFORCE plus `kl_coeff` * KL(q || p), over
    the sampled positions only (`where`, so a prompt position's values never reach the
    sum, even as 0 * inf)."""
    cap = config["clip_high_threshold"]
    log_ratio = torch.where(sampled, logp - old, 0.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=cap).detach()
    kl = ratio - 1.0 - log_ratio
    per_token = -weight * adv * logp
    if config["kl_coeff"]:  # not 0 * kl: a ratio past float range would make it NaN
        per_token = per_token + config["kl_coeff"] * kl
    loss = torch.where(sampled, per_token, 0.0).sum()
    count = int(sampled.sum())
    metrics["tokens:sum"] = float(count)
    metrics["ratio:mean"] = float(ratio.detach()[sampled].mean()) if count else 1.0
    metrics["clip_fraction:mean"] = (float((ratio.detach()[sampled] > cap).float().mean())
                                     if count else 0.0)
    metrics["kl:mean"] = float(kl.detach()[sampled].mean()) if count else 0.0
    return _finish(loss, "stable_reinforce", metrics)


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
