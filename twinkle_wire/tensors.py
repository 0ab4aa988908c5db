"""Tensor coding: numpy arrays and torch tensors to and from the wire's `Tensor`.

Tensors travel as packed little-endian bytes plus dtype and shape: `encode_array` writes
one with a single `tobytes`, `decode_array` reads one with a single `numpy.frombuffer`
after checking that the declared shape matches the payload exactly (no dimension
negative, none too many, the product indexable), so a hostile message is refused before
anything is allocated. Token ids have their own checks (`token_problem`, `token_array`,
`decode_tokens`): integers, non-negative, each fitting int32.

The helpers without a leading underscore are shared with `datums` (datum packing) and the
clients' conversions; the codec's public surface is what `twinkle_wire` exports.
torch is imported lazily, only when a torch tensor is encoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from twinkle_wire._proto.twinkle.v1 import common_pb2 as pb

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
    raise ImportError("twinkle_wire assumes a little-endian host")
_INTEGER_WIRE = {pb.INT64, pb.INT32}
INT32_MAX = np.iinfo(np.int32).max


class WireError(ValueError):
    """A message or array that cannot be encoded or decoded; the message names the field."""


def is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def dtype_name(dtype: int) -> str:
    return pb.DType.Name(dtype) if dtype in pb.DType.values() else str(dtype)


# ----------------------------------------------------------------------------- tensors


def encode_array(value: Any, field: str = "tensor") -> pb.Tensor:
    """Encode a numpy array, a torch tensor (bf16 kept as bf16) or a list as a dense Tensor."""
    tensor = pb.Tensor()
    _fill(tensor, value, field)
    return tensor


def _fill(tensor: pb.Tensor, value: Any, field: str) -> None:
    """Write `value` into a Tensor message in place (no intermediate message to copy)."""
    if is_torch(value):
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


MAX_DIMS = 8
"""Most dimensions a tensor on the wire may have (the contract's tensors have at most 3)."""


def _check_shape(shape: Sequence[int], field: str) -> int:
    """The element count of a declared shape, refused before numpy sees it when a
    dimension is negative, there are too many, or their product could not be indexed
    (numpy would raise its own error even for an empty array)."""
    if len(shape) > MAX_DIMS:
        raise WireError(f"{field}: shape has {len(shape)} dimensions, at most {MAX_DIMS}")
    count, extent = 1, 1
    for dim in shape:
        if dim < 0:
            raise WireError(f"{field}: shape {list(shape)} has a negative dimension")
        count *= dim
        extent *= max(dim, 1)
    if extent > 2**56:  # numpy's byte strides must fit int64 for any dtype
        raise WireError(f"{field}: shape {list(shape)} is too large to index")
    return count


def _frombuffer(data: bytes, dtype: np.dtype, count: int, field: str, what: str) -> np.ndarray:
    if len(data) != count * dtype.itemsize:
        raise WireError(
            f"{field}: {what} holds {len(data)} bytes but {count} x {dtype.itemsize}-byte "
            f"values ({count * dtype.itemsize} bytes) were declared"
        )
    return np.frombuffer(data, dtype=dtype, count=count)


def decode_array(tensor: pb.Tensor, field: str = "tensor") -> np.ndarray:
    """Decode a Tensor to a read-only numpy array (bf16 widened to float32)."""
    tag = tensor.dtype
    dtype = _NP_DTYPES.get(tag)
    if dtype is None:
        raise WireError(f"{field}: unknown dtype tag {dtype_name(tag)}")
    shape = tuple(tensor.shape)
    values = _frombuffer(tensor.data, dtype, _check_shape(shape, field), field, "data")
    if len(shape) != 1:
        values = values.reshape(shape)
    if tag == pb.BFLOAT16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values


# ----------------------------------------------------------------------------- token ids


def token_problem(array: np.ndarray) -> str | None:
    """Why `array` cannot hold token ids (integers, non-negative, fitting int32), or None."""
    if array.dtype.kind not in "iu":
        return f"token ids must be integers, got dtype {array.dtype}"
    if array.size == 0:
        return None
    # One pass: the OR of all values is in [0, INT32_MAX] exactly when each value is
    # (a negative value sets the sign bit, a value past int32 sets a higher bit).
    bits = int(np.bitwise_or.reduce(array, axis=None))
    if 0 <= bits <= INT32_MAX:
        return None
    low = array.min()
    if low < 0:
        return f"token ids must be non-negative, found {int(low)}"
    return f"token id {int(array.max())} does not fit in int32"


ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
REAL_KINDS = "biuf"  # numpy dtype kinds a loss input may have: bool, integers, floats
FLOAT32 = np.dtype(np.float32)


def field_array(value: Any, tokens: bool) -> np.ndarray:
    """A datum field as a numpy array the wire can carry: token ids of dtype int32 or
    int64 (other integer dtypes are widened; their range is checked per chunk by
    `pack_datums`) or real numbers. Raises `WireError` with the problem alone; callers
    add the field's name."""
    array = value if type(value) is np.ndarray else np.asarray(to_numpy(value))
    if tokens:
        if array.dtype in ID_DTYPES:
            return array
        if array.dtype.kind not in "iu":
            raise WireError(f"token ids must be integers, got dtype {array.dtype}")
        if array.dtype.kind == "u" and array.dtype.itemsize == 8:
            problem = token_problem(array)  # uint64 past int64 would wrap when widened
            if problem:
                raise WireError(problem)
        return array.astype(np.int64)
    if array.dtype.kind not in REAL_KINDS:
        raise WireError(f"dtype {array.dtype} is not supported on the wire (loss inputs are "
                        "numbers)")
    return array


def sequence_array(value: Any) -> np.ndarray:
    """Token ids of one sequence: a 1-D array of dtype int32 or int64 (range unchecked);
    `WireError` carries the problem alone."""
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype in ID_DTYPES:
        return value
    array = field_array(value, tokens=True)
    if array.ndim != 1:
        if array.size == 0:
            return array.reshape(-1)
        raise WireError(f"token ids must be 1-D, got shape {list(array.shape)}")
    return array


def token_array(value: Any, field: str) -> np.ndarray:
    """Token ids as a 1-D int32 array: integers, non-negative, each fitting int32; else
    `WireError` naming `field`."""
    try:
        array = sequence_array(value)
    except WireError as exc:
        raise WireError(f"{field}: {exc}") from None
    problem = token_problem(array)
    if problem:
        raise WireError(f"{field}: {problem}")
    return array.astype(np.int32, copy=False)


def decode_integers(tensor: pb.Tensor, field: str, what: str = "dtype") -> np.ndarray:
    """Decode a Tensor that must be INT32 or INT64 (token ids), refusing any other dtype."""
    if tensor.dtype not in _INTEGER_WIRE:
        raise WireError(f"{field}: {what} must be INT32 or INT64, got "
                        f"{dtype_name(tensor.dtype)}")
    return decode_array(tensor, field)


def decode_tokens(tensor: pb.Tensor, field: str) -> np.ndarray:
    """Decode a Tensor of token ids (a prompt): INT32/INT64, 1-D, each in [0, INT32_MAX]."""
    return token_array(decode_integers(tensor, field), field)


def to_numpy(value: Any) -> Any:
    """torch tensors (bf16 widened to float32) and TensorData (densified) as numpy arrays."""
    if is_torch(value):
        import torch

        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.detach().cpu().numpy()
    if hasattr(value, "sparse_crow_indices"):
        return value.to_numpy()
    return value
