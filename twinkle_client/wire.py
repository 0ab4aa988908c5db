"""The one codec between arrays, Tinker/Twinkle inputs and the protobuf wire messages.

Every conversion of a tensor, a datum or a batch to or from the wire goes through this
module, on the client and on the server alike. Tensors travel as packed little-endian
bytes plus dtype and shape (`numpy.frombuffer`, no per-element Python). Datums travel
packed column-wise (`DatumBatch`): a chunk of datums is one array per field plus their
lengths, so encoding and decoding cost a few numpy calls per chunk, not per datum.

Clients turn their inputs into `Datum`s with `encode_datum`, `encode_tinker_datum` or
`encode_feature` (dtypes, shapes and lengths checked per datum: no pass over the
values); `pack_request` groups them under a byte budget (`chunk_datums`) and packs every
group before anything is sent (`pack_datums`), checking token ids a whole column at a
time and narrowing them to int32. The server's `unpack_datums` validates a message
before it allocates (a declared shape must match the payload size exactly, dimensions
must be non-negative, token ids must be non-negative and fit int32, lengths must add
up) and splits it back into `Datum`s. Each failure is a `WireError` whose message names
the field and, where it is one datum's, the datum by its index in the request.

torch is imported lazily, only when a torch tensor is encoded.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from twinkle_client._proto.twinkle.v1 import common_pb2 as pb
from twinkle_client._proto.twinkle.v1 import training_pb2

# gRPC's default receive limit is 4 MiB: no message is larger, so neither side ever needs
# a raised limit. Datum chunks aim lower: at 512 KiB a stream pipelines (the server
# decodes one chunk while the next is in flight) and each chunk's buffers stay small
# enough to reuse memory instead of mapping fresh pages (measured by `bench.codec`).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 512 * 1024

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
_INT32_MAX = np.iinfo(np.int32).max

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
        raise WireError(f"{field}: unknown dtype tag {_dtype_name(tag)}")
    shape = tuple(tensor.shape)
    values = _frombuffer(tensor.data, dtype, _check_shape(shape, field), field, "data")
    if len(shape) != 1:
        values = values.reshape(shape)
    if tag == pb.BFLOAT16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return values


def decode_tensor_data(tensor: pb.Tensor, field: str = "tensor") -> Any:
    """Decode a Tensor to a dense `tinker.types.TensorData` (int64 or float32, as Tinker uses)."""
    from tinker.types import TensorData

    array = decode_array(tensor, field)
    if array.dtype.kind in "iu":
        return TensorData.from_numpy(array.astype(np.int64, copy=False))
    return TensorData.from_numpy(array.astype(np.float32, copy=False))


# ----------------------------------------------------------------------------- datums


@dataclasses.dataclass(frozen=True, slots=True)
class Datum:
    """One training sequence in Tinker form, as numpy arrays.

    `input_ids` is 1-D `[T]`. `loss_inputs` holds arrays with the token axis first:
    `target_tokens` (`[T]`, or `[T, K]` for several targets per position), `weights`,
    and for RL losses `logprobs` (the sampler's) and `advantages`. Token ids are int32
    or int64 and other loss inputs real numbers; `pack_datums` checks each chunk's
    token ids and narrows them to the wire's int32 (other inputs to float32), so the
    datums `unpack_datums` gives the server hold int32 and float32 arrays.
    """

    input_ids: np.ndarray
    loss_inputs: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def _token_problem(array: np.ndarray) -> str | None:
    """Why `array` cannot hold token ids (integers, non-negative, fitting int32), or None."""
    if array.dtype.kind not in "iu":
        return f"token ids must be integers, got dtype {array.dtype}"
    if array.size == 0:
        return None
    # One pass: the OR of all values is in [0, INT32_MAX] exactly when each value is
    # (a negative value sets the sign bit, a value past int32 sets a higher bit).
    bits = int(np.bitwise_or.reduce(array, axis=None))
    if 0 <= bits <= _INT32_MAX:
        return None
    low = array.min()
    if low < 0:
        return f"token ids must be non-negative, found {int(low)}"
    return f"token id {int(array.max())} does not fit in int32"


_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
_REAL_KINDS = "biuf"  # numpy dtype kinds a loss input may have: bool, integers, floats
_FLOAT32 = np.dtype(np.float32)


def _datum_field(value: Any, tokens: bool) -> np.ndarray:
    """A datum field as a numpy array the wire can carry: token ids of dtype int32 or
    int64 (other integer dtypes are widened; their range is checked per chunk by
    `pack_datums`) or real numbers. Raises `WireError` with the problem alone; callers
    add the field's name."""
    array = value if type(value) is np.ndarray else np.asarray(_to_numpy(value))
    if tokens:
        if array.dtype in _ID_DTYPES:
            return array
        if array.dtype.kind not in "iu":
            raise WireError(f"token ids must be integers, got dtype {array.dtype}")
        if array.dtype.kind == "u" and array.dtype.itemsize == 8:
            problem = _token_problem(array)  # uint64 past int64 would wrap when widened
            if problem:
                raise WireError(problem)
        return array.astype(np.int64)
    if array.dtype.kind not in _REAL_KINDS:
        raise WireError(f"dtype {array.dtype} is not supported on the wire (loss inputs are "
                        "numbers)")
    return array


def _sequence(value: Any) -> np.ndarray:
    """Token ids of one sequence: a 1-D array of dtype int32 or int64 (range unchecked);
    `WireError` carries the problem alone."""
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype in _ID_DTYPES:
        return value
    array = _datum_field(value, tokens=True)
    if array.ndim != 1:
        if array.size == 0:
            return array.reshape(-1)
        raise WireError(f"token ids must be 1-D, got shape {list(array.shape)}")
    return array


def _datum_ids(value: Any, index: int) -> np.ndarray:
    """`_sequence` of datum `index`'s input_ids, its errors naming them."""
    try:
        return _sequence(value)
    except WireError as exc:
        raise WireError(f"datum[{index}].input_ids: {exc}") from None


def token_array(value: Any, field: str) -> np.ndarray:
    """Token ids as a 1-D int32 array: integers, non-negative, each fitting int32; else
    `WireError` naming `field`."""
    try:
        array = _sequence(value)
    except WireError as exc:
        raise WireError(f"{field}: {exc}") from None
    problem = _token_problem(array)
    if problem:
        raise WireError(f"{field}: {problem}")
    return array.astype(np.int32, copy=False)


def _decode_integers(tensor: pb.Tensor, field: str, what: str = "dtype") -> np.ndarray:
    """Decode a Tensor that must be INT32 or INT64 (token ids), refusing any other dtype."""
    if tensor.dtype not in _INTEGER_WIRE:
        raise WireError(f"{field}: {what} must be INT32 or INT64, got "
                        f"{_dtype_name(tensor.dtype)}")
    return decode_array(tensor, field)


def decode_tokens(tensor: pb.Tensor, field: str) -> np.ndarray:
    """Decode a Tensor of token ids (a prompt): INT32/INT64, 1-D, each in [0, INT32_MAX]."""
    return token_array(_decode_integers(tensor, field), field)


def _misaligned(array: np.ndarray, length: int) -> str | None:
    """Why a loss input does not line up with `length` input tokens, or None."""
    if array.ndim and array.shape[0] == length:
        return None
    return (f"first dimension is {array.shape[0] if array.ndim else 'missing (scalar)'} but "
            f"input_ids has {length} tokens")


def _aligned_field(value: Any, tokens: bool, length: int) -> np.ndarray:
    """A loss input as `_datum_field` makes it, its first dimension checked against the
    datum's `length` input tokens; `WireError` carries the problem alone."""
    if (type(value) is np.ndarray and value.ndim and value.shape[0] == length
            and (value.dtype in _ID_DTYPES if tokens else value.dtype.kind in _REAL_KINDS)):
        return value
    array = _datum_field(value, tokens)
    problem = _misaligned(array, length)
    if problem:
        raise WireError(problem)
    return array


def encode_datum(input_ids: Any, loss_inputs: Mapping[str, Any], index: int = 0) -> Datum:
    """Token ids plus aligned loss inputs (arrays, tensors or TensorData) as a Datum; a
    wrong dtype, shape or length raises `WireError` naming datum and field. Token id
    ranges are checked when the datum is packed (`pack_datums`), a chunk at a time."""
    ids = _datum_ids(input_ids, index)
    length = ids.shape[0]
    inputs: dict[str, np.ndarray] = {}
    try:
        for key, value in loss_inputs.items():
            inputs[key] = _aligned_field(value, key in TOKEN_FIELDS, length)
    except WireError as exc:
        raise WireError(f"datum[{index}].loss_inputs[{key!r}]: {exc}") from None
    return Datum(ids, inputs)


def encode_tinker_datum(datum: Any, index: int = 0) -> Datum:
    """Encode a `tinker.types.Datum` (text chunks only; sparse inputs are sent dense)."""
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
    """torch tensors (bf16 widened to float32) and TensorData (densified) as numpy arrays."""
    if _is_torch(value):
        import torch

        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.detach().cpu().numpy()
    if hasattr(value, "sparse_crow_indices"):
        return value.to_numpy()
    return value


def encode_feature(feature: Mapping[str, Any], index: int = 0) -> Datum:
    """Encode a Twinkle input feature (`input_ids`, shifted `labels`, RL extras) as a Datum."""
    ids, inputs = feature_to_loss_inputs(feature, index)
    return encode_datum(ids, inputs, index)


# ----------------------------------------------------------------------------- batches


def _layout(datum: Datum) -> tuple[tuple, int]:
    """What datums must share to pack into one DatumBatch (loss-input keys in order and
    their trailing shapes; each key's wire dtype follows from the key), and an upper
    bound of the bytes the datum adds to one (4 per value, plus its length varint)."""
    try:
        signature, values = [], len(datum.input_ids)
        for key, array in datum.loss_inputs.items():
            signature.append((key, array.shape[1:]))
            values += array.size
    except (AttributeError, TypeError):  # a hand-built datum's lists, tensors or scalars
        inputs = {key: np.asarray(_to_numpy(value)) for key, value in datum.loss_inputs.items()}
        return _layout(Datum(np.asarray(_to_numpy(datum.input_ids)).reshape(-1), inputs))
    return tuple(signature), 10 + 4 * values


def _batch_overhead(signature: tuple) -> int:
    """Upper bound of a DatumBatch's bytes besides its values: tags, shapes, map keys."""
    return 64 + sum(len(key.encode()) + 64 for key, _ in signature)


def chunk_datums(datums: Sequence[Datum], max_bytes: int = DEFAULT_CHUNK_BYTES,
                 first: int = 0) -> Iterator[list[Datum]]:
    """Split datums into consecutive groups that each pack within `max_bytes`.

    A group's datums share their loss-input keys and trailing shapes, so each group is
    one `DatumBatch`; concatenating the groups gives back the datums in order. A datum
    larger than `max_bytes` travels alone in its group; one that cannot fit in a message
    a peer accepts (`MAX_MESSAGE_BYTES`, which also caps `max_bytes`) raises `WireError`
    naming it (numbered from `first`) and its size.
    """
    max_bytes = min(max_bytes, MAX_MESSAGE_BYTES)
    chunk: list[Datum] = []
    size = 0
    signature: tuple | None = None
    overhead = 0
    for index, datum in enumerate(datums, first):
        own, need = _layout(datum)
        changed = own != signature
        if changed:
            overhead = _batch_overhead(own)
        if overhead + need > MAX_MESSAGE_BYTES:
            raise WireError(
                f"datum[{index}]: encodes to {overhead + need} bytes, over the "
                f"{MAX_MESSAGE_BYTES}-byte message limit; split the sequence"
            )
        if chunk and (changed or size + need > max_bytes):
            yield chunk
            chunk = []
        if not chunk:
            size, signature = overhead, own
        chunk.append(datum)
        size += need
    if chunk:
        yield chunk


def _converted(arrays: list[Any], lengths: list[int], tokens: bool, field: str,
               first: int) -> list[np.ndarray]:
    """The arrays of one field of a group as `encode_datum` would have made them, each
    checked against its datum's length and the group's trailing shape: for datums built
    by hand rather than by `encode_datum`."""
    out = []
    trailing = None
    for index, (array, length) in enumerate(zip(arrays, lengths, strict=True), first):
        try:
            array = _aligned_field(array, tokens, length)
        except WireError as exc:
            raise WireError(f"datum[{index}].{field}: {exc}") from None
        trailing = array.shape[1:] if trailing is None else trailing
        if array.shape[1:] != trailing:
            raise WireError(f"datum[{index}].{field}: shape {list(array.shape)} does not stack "
                            f"with the batch's [T, {', '.join(map(str, trailing))}]")
        out.append(array)
    return out


def _column_bytes(arrays: list[Any], lengths: list[int], offsets: list[int], tokens: bool,
                  field: str, first: int) -> tuple[bytes, tuple[int, ...]]:
    """One field of a group concatenated along the token axis, as wire bytes and shape:
    token ids checked and narrowed to int32, other values float32.

    Arrays as `encode_datum` makes them cost one shape comparison each, their dtype is
    checked once on the whole column, and token ids once for the whole group (a bad one
    is reported with its datum's index); anything else goes through `_converted`.
    """
    fits = False
    if {type(array) for array in arrays} == {np.ndarray}:  # not a hand-built list or tensor
        trailing = arrays[0].shape[1:]
        fits = [array.shape for array in arrays] == [(n, *trailing) for n in lengths]
    if not fits:
        arrays = _converted(arrays, lengths, tokens, field, first)
        trailing = arrays[0].shape[1:]
    shape = (offsets[-1], *trailing)
    if not tokens and {array.dtype for array in arrays} == {_FLOAT32}:
        try:
            return b"".join(arrays), shape
        except TypeError:  # a non-contiguous array: concatenated below
            pass
    try:
        column = np.concatenate(arrays)
    except TypeError:  # dtypes without a common one
        column = None
    if column is None or not (column.dtype in _ID_DTYPES if tokens
                              else column.dtype.kind in _REAL_KINDS):
        # A dtype the wire cannot carry, or dtypes that promote together to one (int64
        # and uint64 to float64): each array is converted, or refused, on its own.
        column = np.concatenate(_converted(arrays, lengths, tokens, field, first))
    if not tokens:
        return column.astype(_FLOAT32, copy=False).tobytes(), shape
    _check_token_column(column, offsets, first, field)
    if column.dtype.itemsize == 8:  # every id fits: each value's low 32 bits are its int32
        column = column.reshape(-1).view(np.int32)[::2]
    return column.tobytes(), shape


def _fill_column(tensor: pb.Tensor, arrays: list[Any], lengths: list[int], offsets: list[int],
                 tokens: bool, field: str, first: int) -> None:
    """Write one field of a group into `tensor` (see `_column_bytes`)."""
    data, shape = _column_bytes(arrays, lengths, offsets, tokens, field, first)
    tensor.dtype = pb.INT32 if tokens else pb.FLOAT32
    tensor.shape[:] = shape
    tensor.data = data


def pack_datums(datums: Sequence[Datum], first: int = 0, batch: pb.DatumBatch | None = None
                ) -> pb.DatumBatch:
    """One DatumBatch of consecutive datums (a group from `chunk_datums`); `first` is the
    index of its first datum in the request, for error messages. A token id that is
    negative or past int32 raises `WireError` naming its datum.

    Packs into `batch` when given (an empty field of a larger message: building the
    batch alone and then setting it would copy its payload once more).
    """
    batch = pb.DatumBatch() if batch is None else batch
    ids = [datum.input_ids for datum in datums]
    if not all([type(array) is np.ndarray and array.ndim == 1 for array in ids]):
        ids = [_datum_ids(array, index) for index, array in enumerate(ids, first)]
    lengths = [len(array) for array in ids]
    batch.lengths.extend(lengths)
    offsets = list(itertools.accumulate(lengths, initial=0))
    _fill_column(batch.input_ids, ids or [np.zeros(0, np.int32)], lengths or [0], offsets,
                 True, "input_ids", first)
    keys = datums[0].loss_inputs.keys() if datums else {}
    for index, datum in enumerate(datums, first):
        if datum.loss_inputs.keys() != keys:
            raise WireError(f"datum[{index}].loss_inputs: keys {sorted(datum.loss_inputs)} "
                            f"differ from the batch's {sorted(keys)}; pack groups made by "
                            "chunk_datums")
    for key in keys:
        _fill_column(batch.loss_inputs[key], [d.loss_inputs[key] for d in datums], lengths,
                     offsets, key in TOKEN_FIELDS, f"loss_inputs[{key!r}]", first)
    return batch


def pack_request(datums: Sequence[Datum], max_bytes: int = DEFAULT_CHUNK_BYTES,
                 first: int = 0) -> list[training_pb2.ForwardChunk]:
    """The datum chunks of one Forward(Backward) stream, every one packed before the
    caller sends anything: a bad datum anywhere raises `WireError` naming it by its
    index in the request (`first` for `datums[0]`)."""
    chunks, packed = [], first
    for group in chunk_datums(datums, max_bytes, first):
        chunk = training_pb2.ForwardChunk()
        pack_datums(group, packed, chunk.batch)
        chunks.append(chunk)
        packed += len(group)
    return chunks


def _check_token_column(column: np.ndarray, offsets: list[int], first: int, what: str) -> None:
    """Token ids of a whole batch at once (`offsets[i]` is where datum i starts); a bad
    one is reported with its datum's index and that datum's own offending value."""
    if _token_problem(column) is None:
        return
    rows = column.reshape(column.shape[0], -1)
    bad_row = int(np.flatnonzero(((rows < 0) | (rows > _INT32_MAX)).any(axis=1))[0])
    datum = bisect.bisect_right(offsets, bad_row) - 1
    own = column[offsets[datum]:offsets[datum + 1]]
    raise WireError(f"datum[{first + datum}].{what}: {_token_problem(own)}")


def unpack_datums(batch: pb.DatumBatch, first: int = 0) -> list[Datum]:
    """Validate a DatumBatch and split it into its datums, numbered from `first` in errors.

    The datums hold int32 token ids and float32 loss inputs, read-only views of one
    array per field (INT64 token ids, checked to fit, are narrowed to int32).
    """
    lengths = list(batch.lengths)
    if not lengths:
        return []
    if min(lengths) < 0:
        index = next(i for i, length in enumerate(lengths) if length < 0)
        raise WireError(f"datum[{first + index}]: length {lengths[index]} is negative")
    ids = _decode_integers(batch.input_ids, "batch.input_ids")
    if ids.ndim != 1:
        raise WireError(f"batch.input_ids: must be 1-D, got shape {list(ids.shape)}")
    total = ids.shape[0]
    offsets = list(itertools.accumulate(lengths, initial=0))
    if offsets[-1] != total:
        raise WireError(f"batch.lengths: {len(lengths)} lengths do not add up to the {total} "
                        "tokens of input_ids")
    _check_token_column(ids, offsets, first, "input_ids")
    ids = ids.astype(np.int32, copy=False)
    columns: dict[str, np.ndarray] = {}
    for key, tensor in batch.loss_inputs.items():
        field = f"loss_inputs[{key!r}]"
        tokens = key in TOKEN_FIELDS
        column = (_decode_integers(tensor, f"batch.{field}", "token ids") if tokens
                  else decode_array(tensor, f"batch.{field}"))
        problem = _misaligned(column, total)
        if problem:
            raise WireError(f"batch.{field}: {problem}")
        if tokens:
            _check_token_column(column, offsets, first, field)
            column = column.astype(np.int32, copy=False)
        else:
            column = column.astype(np.float32, copy=False)
        columns[key] = column
    items = columns.items()
    return [Datum(ids[a:b], {key: column[a:b] for key, column in items})
            for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
