"""Input processors: any batch shape a training loop holds -> one feature per sequence.

The server takes one datum per sequence, unpadded, so whatever the loop hands to
`forward_backward` is brought back to a list of per-sequence features (`input_ids`,
shifted `labels` with -100 = no loss, optional `weights`, `old_logps`, `advantages`)
before `features.encode_feature` puts each on the wire. Accepted shapes:

- a list of features, as a dataset or `DataLoader` yields them;
- a single feature (`input_ids` is one sequence);
- a batch dict, as a padding collator produces it: `input_ids` a list of lists, a 2-D
  numpy array or torch tensor, with an optional `attention_mask` of the same shape. Each
  row keeps exactly the positions its mask marks (one contiguous run: right or left
  padding); without a mask every row is kept whole.

Nothing is truncated or converted here: rows are sliced in the type they came in (list,
numpy or torch), and a shape that does not fit raises `ProcessorError` naming the field.
`InputProcessor.collate` does the reverse (pads features into a batch dict), for loops
that want batch tensors and for checking that both directions agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from twinkle_client.features import IGNORE_INDEX

Feature = dict[str, Any]

TOKEN_KEYS = ("input_ids", "labels", "weights", "old_logps", "logprobs", "advantages")
"""Per-token keys: each row of these is aligned with the row's input_ids."""
PER_SEQUENCE_KEYS = ("advantages",)
"""Keys that may also hold one value per sequence (a batch dict of shape [B])."""
DROPPED_KEYS = frozenset({"attention_mask", "position_ids"})
"""Batch-only keys: they describe padding and positions, which the server derives itself."""
PADDING_SIDES = ("right", "left")


class ProcessorError(ValueError):
    """Inputs whose shape cannot be turned into per-sequence features; names the field."""


def _ndim(value: Any) -> int:
    """Dimensions of an array, a tensor or a (nested) list; ragged lists count by their
    first element."""
    if hasattr(value, "ndim"):
        return int(value.ndim)
    if isinstance(value, (list, tuple)):
        return 1 + (_ndim(value[0]) if value else 0)
    return 0


def _length(value: Any) -> int:
    return int(value.shape[0]) if hasattr(value, "shape") else len(value)


def _as_ints(row: Any) -> list[int]:
    """A mask row as Python ints (only the mask is read here; data rows are sliced)."""
    values = row.tolist() if hasattr(row, "tolist") else list(row)
    return [int(v) for v in values]


def _kept_span(mask_row: Any, field: str) -> tuple[int, int]:
    """[start, end) of the one run of ones in a 0/1 attention-mask row."""
    mask = _as_ints(mask_row)
    if any(v not in (0, 1) for v in mask):
        raise ProcessorError(f"{field}: must hold only 0 and 1, got {sorted(set(mask))}")
    ones = [i for i, v in enumerate(mask) if v]
    if not ones:
        raise ProcessorError(f"{field}: masks out every position; drop the empty row")
    start, end = ones[0], ones[-1] + 1
    if end - start != len(ones):
        raise ProcessorError(f"{field}: the ones are not contiguous (positions {ones[:8]}...); "
                             "only right or left padding can be stripped, not packed rows")
    return start, end


def _is_feature_list(inputs: Any) -> bool:
    return isinstance(inputs, (list, tuple)) and all(isinstance(x, Mapping) for x in inputs)


def to_features(inputs: Any) -> list[Feature]:
    """Per-sequence features from a list of features, a single feature or a batch dict.

    Raises:
        ProcessorError: empty inputs, a missing `input_ids`, a per-token field whose
            length differs from its row's, a mask of another shape, a non-0/1 or
            non-contiguous mask row, or input_ids of more than two dimensions.
    """
    if _is_feature_list(inputs):
        if not inputs:
            raise ProcessorError("inputs: the batch is empty")
        features: list[Feature] = []
        for index, item in enumerate(inputs):
            if "input_ids" not in item:
                raise ProcessorError(f"inputs[{index}]: missing 'input_ids'")
            if _ndim(item["input_ids"]) != 1:
                raise ProcessorError(f"inputs[{index}].input_ids: must be one sequence (1-D), "
                                     f"got {_ndim(item['input_ids'])} dimensions")
            features.extend(_split_batch(dict(item), f"inputs[{index}]"))
        return features
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            raise ProcessorError(f"inputs: missing 'input_ids' (got keys {sorted(inputs)})")
        return _split_batch(dict(inputs), "inputs")
    raise ProcessorError(f"inputs: expected a feature dict, a list of feature dicts or a batch "
                         f"dict of lists/arrays/tensors, got {type(inputs).__name__}")


def _split_batch(batch: Mapping[str, Any], field: str) -> list[Feature]:
    """A single feature (1-D input_ids) -> [it, checked]; a batch dict (2-D) -> its rows."""
    ids = batch["input_ids"]
    dims = _ndim(ids)
    if dims == 1:
        feature = {k: v for k, v in batch.items() if k not in DROPPED_KEYS}
        mask = batch.get("attention_mask")
        if mask is not None:
            return [_strip_row(feature, mask, f"{field}.attention_mask")]
        _check_row(feature, field)
        return [feature]
    if dims != 2:
        raise ProcessorError(f"{field}.input_ids: must be one sequence (1-D) or a batch (2-D), "
                             f"got {dims} dimensions")
    rows = _length(ids)
    if rows == 0:
        raise ProcessorError(f"{field}.input_ids: the batch is empty")
    for key, value in batch.items():
        if key in DROPPED_KEYS and key != "attention_mask":
            continue
        if value is not None and (key in TOKEN_KEYS or key == "attention_mask") \
                and _length(value) != rows:
            raise ProcessorError(f"{field}.{key}: has {_length(value)} rows but input_ids has "
                                 f"{rows}")
    mask = batch.get("attention_mask")
    out = []
    for row in range(rows):
        feature: Feature = {}
        for key, value in batch.items():
            if key in DROPPED_KEYS:
                continue
            if value is not None and (key in TOKEN_KEYS or _is_batched(value, rows)):
                feature[key] = value[row]
            else:
                feature[key] = value
        if mask is not None:
            out.append(_strip_row(feature, mask[row], f"{field}.attention_mask[{row}]"))
        else:
            _check_row(feature, f"{field}[{row}]")
            out.append(feature)
    return out


def _is_batched(value: Any, rows: int) -> bool:
    """A non-token value with one entry per row (e.g. a list of per-sequence scalars)."""
    return _ndim(value) >= 1 and _length(value) == rows


def _per_token(key: str, value: Any) -> bool:
    return (key in TOKEN_KEYS and value is not None
            and not (key in PER_SEQUENCE_KEYS and _ndim(value) == 0))


def _check_row(feature: Feature, field: str) -> None:
    length = _length(feature["input_ids"])
    for key, value in feature.items():
        if _per_token(key, value) and _length(value) != length:
            raise ProcessorError(f"{field}.{key}: has {_length(value)} positions but input_ids "
                                 f"has {length}")


def _strip_row(feature: Feature, mask_row: Any, field: str) -> Feature:
    """Keep exactly the masked positions of every per-token field of one row."""
    length = _length(feature["input_ids"])
    if _ndim(mask_row) != 1 or _length(mask_row) != length:
        raise ProcessorError(f"{field}: has shape {_shape(mask_row)} but the row's input_ids "
                             f"has {length} positions")
    _check_row(feature, field.rsplit(".attention_mask", 1)[0])
    start, end = _kept_span(mask_row, field)
    return {key: value[start:end] if _per_token(key, value) else value
            for key, value in feature.items()}


def _shape(value: Any) -> list[int]:
    if hasattr(value, "shape"):
        return list(value.shape)
    return [len(value)] if isinstance(value, (list, tuple)) else []


class InputProcessor:
    """Turns a training loop's batch into per-sequence features, and pads the reverse way.

    Args:
        padding_side: 'right' or 'left': where `collate` puts the padding. Stripping
            reads the attention mask, so it accepts either side whatever this says.
        pad_token_id: the input id `collate` pads with (the server never sees it).

    Example:
        batch = InputProcessor('left').collate(features)   # padded numpy arrays + mask
        assert InputProcessor()(batch) == features         # equal, padding stripped
    """

    def __init__(self, padding_side: str = "right", pad_token_id: int = 0) -> None:
        if padding_side not in PADDING_SIDES:
            raise ProcessorError(f"padding_side: {padding_side!r} is not one of {PADDING_SIDES}")
        self.padding_side = padding_side
        self.pad_token_id = int(pad_token_id)

    def __call__(self, inputs: Any) -> list[Feature]:
        """Per-sequence features; see `to_features`."""
        return to_features(inputs)

    def collate(self, features: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
        """Pad features into a batch dict of numpy arrays with an `attention_mask`.

        input_ids pad with `pad_token_id`, labels with -100, float fields with 0.
        Per-sequence values (a scalar `advantages`) become one entry per row.
        """
        features = to_features(list(features))
        width = max(_length(f["input_ids"]) for f in features)
        keys = [k for k in features[0] if k in TOKEN_KEYS]
        for index, feature in enumerate(features):
            if [k for k in feature if k in TOKEN_KEYS] != keys:
                raise ProcessorError(f"features[{index}]: has fields "
                                     f"{[k for k in feature if k in TOKEN_KEYS]} but "
                                     f"features[0] has {keys}; collate needs the same fields")
        batch: dict[str, np.ndarray] = {}
        for key in keys:
            rows = [np.asarray(f[key]) for f in features]
            if key in PER_SEQUENCE_KEYS and rows[0].ndim == 0:
                batch[key] = np.stack(rows)
                continue
            fill = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX}.get(key, 0)
            batch[key] = np.stack([self._pad(r, width, fill) for r in rows])
        lengths = [_length(f["input_ids"]) for f in features]
        batch["attention_mask"] = np.stack([self._pad(np.ones(n, np.int64), width, 0)
                                            for n in lengths])
        return batch

    def _pad(self, row: np.ndarray, width: int, fill: float) -> np.ndarray:
        pad = np.full(width - row.shape[0], fill, dtype=row.dtype)
        return np.concatenate([row, pad] if self.padding_side == "right" else [pad, row])

    def __repr__(self) -> str:
        return f"InputProcessor(padding_side={self.padding_side!r})"


PROCESSORS: dict[str, Callable[..., InputProcessor]] = {"InputProcessor": InputProcessor}
"""Processors `set_processor` accepts by name."""


def make_processor(processor: str | type | InputProcessor, **kwargs: Any) -> InputProcessor:
    """A processor from a registered name, a class (called with `kwargs`) or an instance."""
    if isinstance(processor, str):
        if processor not in PROCESSORS:
            raise ProcessorError(f"processor: {processor!r} is not one of {sorted(PROCESSORS)}")
        return PROCESSORS[processor](**kwargs)
    if isinstance(processor, type):
        return processor(**kwargs)
    if kwargs:
        raise ProcessorError("processor: kwargs are only for a name or a class, not an instance")
    if not callable(processor):
        raise ProcessorError(f"processor: {processor!r} is not callable")
    return processor
