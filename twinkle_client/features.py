"""Twinkle input features: the native client's training rows and how they reach the wire.

A feature is one sequence: `input_ids` [T] and shifted `labels` [T] (`labels[t]` is the
token to predict at position `t`; `IGNORE_INDEX`, -100, marks a position with no loss),
optionally per-position `weights` and the RL inputs `old_logps` and `advantages`. It
becomes Tinker's form (`target_tokens`, `weights`, `logprobs`, `advantages`) with
`feature_to_loss_inputs`, and a wire datum with `encode_feature` (through
`wire.encode_datum`, the one path every client's datums take); `loss_inputs_to_feature`
is the inverse. `align_per_token` and `rollout_feature` build the RL parts of a feature
from what a sampler returned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from twinkle_wire import Datum, WireError, encode_datum
from twinkle_wire.tensors import to_numpy

IGNORE_INDEX = -100
"""Label value that marks a position with no loss (prompt tokens, padding)."""


def feature_to_loss_inputs(feature: Mapping[str, Any], index: int = 0) -> tuple[np.ndarray, dict]:
    """A Twinkle input feature to Tinker-form arrays.

    `labels` are already shifted: `labels[t]` is the token to predict at position `t`
    and -100 marks no loss, so `target_tokens = labels` (0 where ignored) and
    `weights = labels != -100` (optional per-position `weights` scale that, and are 0
    wherever the label is -100). Optional RL inputs: `old_logps` -> `logprobs`,
    `advantages` (per token, or one value per sequence, broadcast over its tokens).
    """
    field = f"feature[{index}]"
    if "input_ids" not in feature:
        raise WireError(f"{field}: missing 'input_ids'")
    ids = np.asarray(to_numpy(feature["input_ids"]))
    length = ids.shape[0] if ids.ndim == 1 else -1
    inputs: dict[str, np.ndarray] = {}
    if "labels" in feature:
        labels = np.asarray(to_numpy(feature["labels"]))
        if labels.dtype.kind not in "iu":
            raise WireError(f"{field}.labels: must be integers, got dtype {labels.dtype}")
        if labels.shape != ids.shape:
            raise WireError(
                f"{field}.labels: has shape {list(labels.shape)} but input_ids has "
                f"{list(ids.shape)}; labels are shifted and aligned with input_ids"
            )
        mask = labels != IGNORE_INDEX
        if np.any(labels[mask] < 0):
            raise WireError(f"{field}.labels: negative label other than {IGNORE_INDEX}")
        inputs["target_tokens"] = np.where(mask, labels, 0).astype(np.int64)
        weights = feature.get("weights")
        if weights is None:
            inputs["weights"] = mask.astype(np.float32)
        else:
            weights = np.asarray(to_numpy(weights), dtype=np.float32)
            if weights.shape != labels.shape:
                raise WireError(f"{field}.weights: has shape {list(weights.shape)} but labels "
                                f"has {list(labels.shape)}")
            # A -100 label means no loss there, whatever weight came with it.
            inputs["weights"] = np.where(mask, weights, np.float32(0))
    elif feature.get("weights") is not None:
        raise WireError(f"{field}.weights: given without 'labels'; weights scale the loss of "
                        "labelled positions")
    for src, dst in (("old_logps", "logprobs"), ("logprobs", "logprobs"),
                     ("advantages", "advantages")):
        if src in feature and feature[src] is not None:
            value = np.asarray(to_numpy(feature[src]), dtype=np.float32)
            if value.ndim == 0 or value.size == 1 and length != 1:
                value = np.full(length, float(value.reshape(-1)[0]), dtype=np.float32)
            inputs[dst] = value
    return ids, inputs


def loss_inputs_to_feature(input_ids: np.ndarray, loss_inputs: Mapping[str, np.ndarray]) -> dict:
    """Tinker-form arrays back to a Twinkle input feature (the inverse of the above)."""
    feature: dict[str, np.ndarray] = {"input_ids": np.asarray(input_ids, dtype=np.int64)}
    if "target_tokens" in loss_inputs:
        targets = np.asarray(loss_inputs["target_tokens"], dtype=np.int64)
        weights = np.asarray(loss_inputs.get("weights", np.ones(targets.shape)), dtype=np.float32)
        feature["labels"] = np.where(weights != 0, targets, IGNORE_INDEX)
        if np.any((weights != 0) & (weights != 1)):
            feature["weights"] = weights
    if "logprobs" in loss_inputs:
        feature["old_logps"] = np.asarray(loss_inputs["logprobs"], dtype=np.float32)
    if "advantages" in loss_inputs:
        feature["advantages"] = np.asarray(loss_inputs["advantages"], dtype=np.float32)
    return feature


def encode_feature(feature: Mapping[str, Any], index: int = 0) -> Datum:
    """Encode a Twinkle input feature (`input_ids`, shifted `labels`, RL extras) as a Datum."""
    ids, inputs = feature_to_loss_inputs(feature, index)
    return encode_datum(ids, inputs, index)


def align_per_token(values: Any, feature: Mapping[str, Any], field_name: str) -> np.ndarray:
    """Per-token RL values aligned with the feature's input_ids: as given when they have
    one per position, else scattered onto the label positions (a sampler's completion
    logprobs), else an error naming both lengths."""
    array = np.asarray(values, dtype=np.float32).reshape(-1)
    length = len(feature["input_ids"])
    if array.size == length:
        return array
    labels = np.asarray(feature.get("labels", np.full(length, IGNORE_INDEX)))
    positions = np.flatnonzero(labels != IGNORE_INDEX)
    if array.size != positions.size:
        raise ValueError(f"{field_name}: has {array.size} values but the sequence has {length} "
                         f"positions and {positions.size} label tokens; give one value per "
                         "position or one per label token")
    out = np.zeros(length, dtype=np.float32)
    out[positions] = array
    return out


def rollout_feature(prompt: np.ndarray, completion: np.ndarray) -> dict[str, np.ndarray]:
    """Prompt + completion as a training feature: shifted labels on the completion only."""
    full = np.concatenate([prompt.astype(np.int64), completion.astype(np.int64)])
    labels = np.full(full.size - 1, IGNORE_INDEX, dtype=np.int64)
    labels[prompt.size - 1:] = completion
    return {"input_ids": full[:-1], "labels": labels}
