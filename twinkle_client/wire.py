"""The one codec between arrays, Tinker/Twinkle inputs and the protobuf wire messages.

Every conversion of a tensor, a datum or a batch to or from the wire goes through this
module, on the client and on the server alike. Tensors travel as packed little-endian
bytes plus dtype and shape (`numpy.frombuffer`, no per-element Python); sparse CSR
tensors (Tinker's 2-D `target_tokens`/`weights`) keep their CSR form on the wire.

Decoding validates before it allocates: a declared shape must match the payload size
exactly, dimensions must be non-negative, token ids must be non-negative integers, and
every loss input must be as long as the datum's `input_ids`. Each failure is a
`WireError` whose message names the field.

torch is imported lazily, only when a torch tensor is encoded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from twinkle_client._proto.twinkle.v1 import common_pb2 as pb

# gRPC's default receive limit is 4 MiB; chunks stay well under it so neither side
# ever needs a raised limit.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024

IGNORE_INDEX = -100
"""Label value that marks a position with no loss (prompt tokens, padding)."""

_NP_DTYPES: dict[int, np.dtype] = {
    pb.INT64: np.dtype("<i8"),
    pb.INT32: np.dtype("<i4"),
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT64: np.dtype("<f8"),
    pb.BFLOAT16: np.dtype("<u2"),  # raw bits; decoded to float32
}
_WIRE_DTYPES: dict[str, int] = {
    "int64": pb.INT64,
    "int32": pb.INT32,
    "float32": pb.FLOAT32,
    "float64": pb.FLOAT64,
}
_WIRE_BY_NUMPY: dict[np.dtype, int] = {
    np.dtype(name): wire for name, wire in _WIRE_DTYPES.items() if np.dtype(name).isnative
}
if np.little_endian is False:  # pragma: no cover - every supported platform is little-endian
    raise ImportError("twinkle_client.wire assumes a little-endian host")
_INTEGER_WIRE = {pb.INT64, pb.INT32}

# Loss inputs whose values are token ids (validated as such).
TOKEN_FIELDS = frozenset({"target_tokens"})


class WireError(ValueError):
    """A message or array that cannot be encoded or decoded; the message names the field."""


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def _dtype_name(dtype: int) -> str:
    return pb.DType.Name(dtype) if dtype in pb.DType.values() else str(dtype)


# ----------------------------------------------------------------------------- tensors


def encode_array(value: Any, field: str = "tensor") -> pb.Tensor:
    """Encode a numpy array, a torch tensor (bf16 kept as bf16) or a list as a dense Tensor."""
    tensor = pb.Tensor()
    _fill(tensor, value, field)
    return tensor


def _fill(tensor: pb.Tensor, value: Any, field: str) -> None:
    """Write `value` into a Tensor message in place (no intermediate message to copy)."""
    if _is_torch(value):
        import torch

        value = value.detach().cpu().contiguous()
        if value.dtype == torch.bfloat16:
            raw = value.view(torch.int16).numpy()
            tensor.dtype = pb.BFLOAT16
            tensor.shape[:] = raw.shape
            tensor.data = raw.tobytes()
            return
        value = value.numpy()
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    wire = _WIRE_BY_NUMPY.get(array.dtype)
    if wire is None:
        if array.dtype != np.bool_:
            raise WireError(
                f"{field}: dtype {array.dtype} is not supported on the wire "
                f"(use one of {sorted(_WIRE_DTYPES)} or bfloat16)"
            )
        array, wire = array.astype(np.float32), pb.FLOAT32
    tensor.dtype = wire
    tensor.shape[:] = array.shape
    tensor.data = array.tobytes()


def _check_shape(shape: Sequence[int], field: str) -> int:
    count = 1
    for dim in shape:
        if dim < 0:
            raise WireError(f"{field}: shape {list(shape)} has a negative dimension")
        count *= dim
    return count


def _frombuffer(data: bytes, dtype: np.dtype, count: int, field: str, what: str) -> np.ndarray:
    if len(data) != count * dtype.itemsize:
        raise WireError(
            f"{field}: {what} holds {len(data)} bytes but {count} x {dtype.itemsize}-byte "
            f"values ({count * dtype.itemsize} bytes) were declared"
        )
    return np.frombuffer(data, dtype=dtype, count=count)


def decode_array(tensor: pb.Tensor, field: str = "tensor") -> np.ndarray:
    """Decode a Tensor to a read-only numpy array (bf16 widened to float32, CSR densified)."""
    if tensor.dtype not in _NP_DTYPES:
        raise WireError(f"{field}: unknown dtype tag {_dtype_name(tensor.dtype)}")
    dtype = _NP_DTYPES[tensor.dtype]
    shape = tuple(tensor.shape)
    if tensor.sparse_crow_indices or tensor.sparse_col_indices:
        values = _decode_csr(tensor, dtype, shape, field)
    else:
        count = _check_shape(shape, field)
        values = _frombuffer(tensor.data, dtype, count, field, "data").reshape(shape)
    if tensor.dtype == pb.BFLOAT16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values


def _decode_csr(tensor: pb.Tensor, dtype: np.dtype, shape: tuple[int, ...], field: str) -> np.ndarray:
    if len(shape) != 2:
        raise WireError(f"{field}: a sparse CSR tensor needs a 2-D shape, got {list(shape)}")
    rows, cols = shape
    _check_shape(shape, field)
    index = np.dtype("<i8")
    if len(tensor.sparse_crow_indices) != (rows + 1) * index.itemsize:
        raise WireError(
            f"{field}: sparse_crow_indices must hold {rows + 1} int64 values for {rows} rows, "
            f"got {len(tensor.sparse_crow_indices)} bytes"
        )
    crow = np.frombuffer(tensor.sparse_crow_indices, dtype=index)
    nnz = int(crow[-1])
    if crow[0] != 0 or np.any(np.diff(crow) < 0) or nnz > rows * cols:
        raise WireError(f"{field}: sparse_crow_indices must start at 0 and never decrease")
    col = _frombuffer(tensor.sparse_col_indices, index, nnz, field, "sparse_col_indices")
    if nnz and (col.min() < 0 or col.max() >= cols):
        raise WireError(f"{field}: sparse_col_indices must lie in [0, {cols})")
    values = _frombuffer(tensor.data, dtype, nnz, field, "data")
    dense = np.zeros(shape, dtype=dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


def encode_tensor_data(td: Any, field: str = "tensor") -> pb.Tensor:
    """Encode a `tinker.types.TensorData`, keeping its sparse CSR form if it has one."""
    if td.sparse_crow_indices is None:
        return encode_array(td.to_numpy(), field)
    wire = _WIRE_DTYPES.get(td.dtype)
    if wire is None:
        raise WireError(f"{field}: dtype {td.dtype} is not supported on the wire")
    return pb.Tensor(
        dtype=wire,
        shape=list(td.shape),
        data=np.ascontiguousarray(td._numpy, dtype=_NP_DTYPES[wire]).tobytes(),
        sparse_crow_indices=np.asarray(td.sparse_crow_indices, dtype="<i8").tobytes(),
        sparse_col_indices=np.asarray(td.sparse_col_indices, dtype="<i8").tobytes(),
    )


def decode_tensor_data(tensor: pb.Tensor, field: str = "tensor") -> Any:
    """Decode a Tensor to a dense `tinker.types.TensorData` (int64 or float32, as Tinker uses)."""
    from tinker.types import TensorData

    array = decode_array(tensor, field)
    if array.dtype.kind in "iu":
        return TensorData.from_numpy(array.astype(np.int64, copy=False))
    return TensorData.from_numpy(array.astype(np.float32, copy=False))


# ----------------------------------------------------------------------------- datums


def token_array(value: Any, field: str) -> np.ndarray:
    """Token ids as a 1-D integer array: non-negative, each fitting int32; else `WireError`."""
    if _is_torch(value):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.size == 0:
        return array.astype(np.int64).reshape(-1)
    if array.dtype.kind not in "iu":
        raise WireError(f"{field}: token ids must be integers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise WireError(f"{field}: token ids must be 1-D, got shape {list(array.shape)}")
    if array.min() < 0:
        raise WireError(f"{field}: token ids must be non-negative, found {int(array.min())}")
    if array.dtype != np.int32 and array.max() > np.iinfo(np.int32).max:
        raise WireError(f"{field}: token id {int(array.max())} does not fit in int32")
    return array


def encode_datum(input_ids: Any, loss_inputs: Mapping[str, Any], index: int = 0) -> pb.Datum:
    """Encode token ids plus aligned loss inputs (arrays, tensors or TensorData) as a Datum."""
    ids = token_array(input_ids, f"datum[{index}].input_ids")
    if ids.dtype != np.int32:
        ids = ids.astype(np.int32)
    datum = pb.Datum()
    datum.input_ids.dtype = pb.INT32
    datum.input_ids.shape.append(ids.shape[0])
    datum.input_ids.data = ids.tobytes()
    for key, value in loss_inputs.items():
        field = f"datum[{index}].loss_inputs[{key!r}]"
        if hasattr(value, "sparse_crow_indices"):
            datum.loss_inputs[key].CopyFrom(encode_tensor_data(value, field))
        else:
            _fill(datum.loss_inputs[key], value, field)
    _check_lengths(ids.shape[0], datum.loss_inputs, index)
    return datum


def _check_lengths(length: int, loss_inputs: Mapping[str, pb.Tensor], index: int) -> None:
    for key, tensor in loss_inputs.items():
        shape = list(tensor.shape)
        if not shape or shape[0] != length:
            raise WireError(
                f"datum[{index}].loss_inputs[{key!r}]: first dimension is "
                f"{shape[0] if shape else 'missing (scalar)'} but input_ids has {length} tokens"
            )


def encode_tinker_datum(datum: Any, index: int = 0) -> pb.Datum:
    """Encode a `tinker.types.Datum` (text chunks only)."""
    try:
        tokens = datum.model_input.to_ints()
    except Exception as exc:
        raise WireError(
            f"datum[{index}].model_input: only text (EncodedTextChunk) inputs are supported: {exc}"
        ) from None
    return encode_datum(np.asarray(tokens, dtype=np.int64), datum.loss_fn_inputs, index)


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
    ids = np.asarray(_to_numpy(feature["input_ids"]))
    length = ids.shape[0] if ids.ndim == 1 else -1
    inputs: dict[str, np.ndarray] = {}
    if "labels" in feature:
        labels = np.asarray(_to_numpy(feature["labels"]))
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
            weights = np.asarray(_to_numpy(weights), dtype=np.float32)
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
            value = np.asarray(_to_numpy(feature[src]), dtype=np.float32)
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


def _to_numpy(value: Any) -> Any:
    return value.detach().cpu().numpy() if _is_torch(value) else value


def encode_feature(feature: Mapping[str, Any], index: int = 0) -> pb.Datum:
    """Encode a Twinkle input feature (`input_ids`, shifted `labels`, RL extras) as a Datum."""
    ids, inputs = feature_to_loss_inputs(feature, index)
    return encode_datum(ids, inputs, index)


def decode_datum(datum: pb.Datum, index: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Decode and validate a Datum: int64 `[T]` input ids and dense loss-input arrays."""
    field = f"datum[{index}]"
    if not datum.HasField("input_ids"):
        raise WireError(f"{field}.input_ids: missing")
    if datum.input_ids.dtype not in _INTEGER_WIRE:
        raise WireError(
            f"{field}.input_ids: dtype must be INT32 or INT64, got "
            f"{_dtype_name(datum.input_ids.dtype)}"
        )
    ids = token_array(decode_array(datum.input_ids, f"{field}.input_ids"),
                          f"{field}.input_ids").astype(np.int64, copy=False)
    _check_lengths(ids.shape[0], datum.loss_inputs, index)
    inputs: dict[str, np.ndarray] = {}
    for key, tensor in datum.loss_inputs.items():
        name = f"{field}.loss_inputs[{key!r}]"
        array = decode_array(tensor, name)
        if key in TOKEN_FIELDS:
            if tensor.dtype not in _INTEGER_WIRE:
                raise WireError(f"{name}: token ids must be INT32 or INT64, got "
                                f"{_dtype_name(tensor.dtype)}")
            if array.size and array.min() < 0:
                raise WireError(f"{name}: token ids must be non-negative, found {int(array.min())}")
            array = array.astype(np.int64, copy=False)
        else:
            array = array.astype(np.float32, copy=False)
        inputs[key] = array
    return ids, inputs


# ----------------------------------------------------------------------------- batches


def chunk_datums(datums: Sequence[pb.Datum], max_bytes: int = DEFAULT_CHUNK_BYTES
                 ) -> Iterator[list[pb.Datum]]:
    """Split datums into consecutive groups whose encoded size stays within `max_bytes`.

    Concatenating the groups gives back the datums in order. A single datum larger than
    the budget cannot be split and raises `WireError` naming its index and size.
    """
    chunk: list[pb.Datum] = []
    size = 0
    for index, datum in enumerate(datums):
        # 16 bytes: the repeated-field tag and length prefix of this datum in its chunk.
        need = datum.ByteSize() + 16
        if need > max_bytes:
            raise WireError(
                f"datum[{index}]: encodes to {need} bytes, over the {max_bytes}-byte chunk "
                f"budget; split the sequence or raise the budget (at most {MAX_MESSAGE_BYTES})"
            )
        if chunk and size + need > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(datum)
        size += need
    if chunk:
        yield chunk
