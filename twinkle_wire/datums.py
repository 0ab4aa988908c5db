"""Datum packing: Tinker-form training sequences to and from `DatumBatch` messages.

A `Datum` is one sequence as numpy arrays: `input_ids` and its loss inputs, token axis
first. `encode_datum` checks dtypes, shapes and lengths per datum (no pass over the
values). `pack_request` groups datums under a byte budget (`chunk_datums`) and packs
every group before anything is sent (`pack_datums`): each field of a group is one array
concatenated along the token axis, token ids checked a whole column at a time and
narrowed to int32, other values sent as float32, so packing and unpacking cost a few
numpy calls per chunk, not per datum. The server's `unpack_datums` validates a message
before it allocates (a declared shape must match its payload, lengths must add up, token
ids must be non-negative and fit int32) and splits it back into `Datum`s. Each failure is
a `WireError` naming the field and, where it is one datum's, the datum by its index in
the request.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from twinkle_wire._proto.twinkle.v1 import common_pb2 as pb
from twinkle_wire._proto.twinkle.v1 import training_pb2
from twinkle_wire.tensors import (
    FLOAT32,
    ID_DTYPES,
    INT32_MAX,
    REAL_KINDS,
    WireError,
    decode_array,
    decode_integers,
    field_array,
    sequence_array,
    to_numpy,
    token_problem,
)

# gRPC's default receive limit is 4 MiB: no message is larger, so neither side ever needs
# a raised limit. Datum chunks aim lower: at 512 KiB a stream pipelines (the server
# decodes one chunk while the next is in flight) and each chunk's buffers stay small
# enough to reuse memory instead of mapping fresh pages (measured by `bench.codec`).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
DEFAULT_CHUNK_BYTES = 512 * 1024

# Loss inputs whose values are token ids (validated as such).
TOKEN_FIELDS = frozenset({"target_tokens"})


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

    @property
    def num_bytes(self) -> int:
        """Bytes of its arrays (input ids and loss inputs)."""
        return self.input_ids.nbytes + sum(a.nbytes for a in self.loss_inputs.values())


def _datum_ids(value: Any, index: int) -> np.ndarray:
    """`sequence_array` of datum `index`'s input_ids, its errors naming them."""
    try:
        return sequence_array(value)
    except WireError as exc:
        raise WireError(f"datum[{index}].input_ids: {exc}") from None


def _misaligned(array: np.ndarray, length: int) -> str | None:
    """Why a loss input does not line up with `length` input tokens, or None."""
    if array.ndim and array.shape[0] == length:
        return None
    return (f"first dimension is {array.shape[0] if array.ndim else 'missing (scalar)'} but "
            f"input_ids has {length} tokens")


def _aligned_field(value: Any, tokens: bool, length: int) -> np.ndarray:
    """A loss input as `field_array` makes it, its first dimension checked against the
    datum's `length` input tokens; `WireError` carries the problem alone."""
    if (type(value) is np.ndarray and value.ndim and value.shape[0] == length
            and (value.dtype in ID_DTYPES if tokens else value.dtype.kind in REAL_KINDS)):
        return value
    array = field_array(value, tokens)
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


def narrow_datum(datum: Datum, index: int = 0) -> Datum:
    """A datum from `encode_datum` as the server holds one, without a trip through a
    `DatumBatch`: token ids checked (integers, non-negative, fitting int32) and narrowed
    to int32, other loss inputs float32, as `pack_datums` and `unpack_datums` make them.
    A bad token id raises `WireError` naming datum and field, as `pack_datums` does."""
    def narrowed(array: np.ndarray, field: str, tokens: bool) -> np.ndarray:
        if not tokens:
            return array.astype(FLOAT32, copy=False)
        problem = token_problem(array)
        if problem:
            raise WireError(f"datum[{index}].{field}: {problem}")
        return array.astype(np.int32, copy=False)
    return Datum(narrowed(datum.input_ids, "input_ids", True),
                 {key: narrowed(value, f"loss_inputs[{key!r}]", key in TOKEN_FIELDS)
                  for key, value in datum.loss_inputs.items()})


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
        inputs = {key: np.asarray(to_numpy(value)) for key, value in datum.loss_inputs.items()}
        return _layout(Datum(np.asarray(to_numpy(datum.input_ids)).reshape(-1), inputs))
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
    if not tokens and {array.dtype for array in arrays} == {FLOAT32}:
        try:
            return b"".join(arrays), shape
        except TypeError:  # a non-contiguous array: concatenated below
            pass
    try:
        column = np.concatenate(arrays)
    except TypeError:  # dtypes without a common one
        column = None
    if column is None or not (column.dtype in ID_DTYPES if tokens
                              else column.dtype.kind in REAL_KINDS):
        # A dtype the wire cannot carry, or dtypes that promote together to one (int64
        # and uint64 to float64): each array is converted, or refused, on its own.
        column = np.concatenate(_converted(arrays, lengths, tokens, field, first))
    if not tokens:
        return column.astype(FLOAT32, copy=False).tobytes(), shape
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
    if token_problem(column) is None:
        return
    rows = column.reshape(column.shape[0], -1)
    bad_row = int(np.flatnonzero(((rows < 0) | (rows > INT32_MAX)).any(axis=1))[0])
    datum = bisect.bisect_right(offsets, bad_row) - 1
    own = column[offsets[datum]:offsets[datum + 1]]
    raise WireError(f"datum[{first + datum}].{what}: {token_problem(own)}")


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
    ids = decode_integers(batch.input_ids, "batch.input_ids")
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
        column = (decode_integers(tensor, f"batch.{field}", "token ids") if tokens
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
