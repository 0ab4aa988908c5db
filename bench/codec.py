"""Codec throughput: 256 datums x 2048 tokens through `twinkle_wire` vs plain numpy.

Run: `.venv/bin/python -m bench.codec` (also part of `make bench`).

Both sides move the same arrays: input ids, target_tokens and weights to bytes and back.
Plain numpy does one `tobytes`/`frombuffer` per array and nothing else. The `codec` row
is the codec's whole work, a chunk at a time: make datums, chunk them, pack each chunk's
columns into a message (token ids checked and narrowed to int32 a whole column at a
time), then validate the message and split it back into datums. `codec + proto` is a
whole request as it travels: the client packs all its chunks before sending any (so a
bad datum fails before anything is sent, and a retry resends the same messages), gRPC
serializes and parses each, the server unpacks. Ratios are throughput over plain
numpy throughput (1.0 = as fast as bare `tobytes`/`frombuffer`).

`unchecked floor` says where the codec's time goes: it moves the same bytes through
`DatumBatch` messages with no validation and no per-datum objects (cast to int32, join,
set into the message, read back), so the gap between it and `codec` is the checks and
the per-datum bookkeeping.
"""

from __future__ import annotations

import functools

import numpy as np

import twinkle_wire as wire
from bench.timing import best_per_call
from twinkle_wire._proto.twinkle.v1 import training_pb2

NUM_DATUMS = 256
SEQ_LEN = 2048
REPEATS = 25


def _batch() -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.integers(0, 32000, SEQ_LEN), rng.integers(0, 32000, SEQ_LEN),
             rng.random(SEQ_LEN).astype(np.float32)) for _ in range(NUM_DATUMS)]


def _numpy_roundtrip(batch) -> int:
    total = 0
    for ids, targets, weights in batch:
        blobs = (ids.astype("<i4").tobytes(), targets.tobytes(), weights.tobytes())
        out = (np.frombuffer(blobs[0], "<i4"), np.frombuffer(blobs[1], "<i8"),
               np.frombuffer(blobs[2], "<f4"))
        total += out[0].shape[0]
    return total


def _encode(batch) -> list[wire.Datum]:
    return [wire.encode_datum(ids, {"target_tokens": targets, "weights": weights}, i)
            for i, (ids, targets, weights) in enumerate(batch)]


def _codec_roundtrip(batch) -> int:
    """Arrays -> datums -> each chunk packed and at once unpacked: the codec's work, a
    chunk at a time as plain numpy goes an array at a time."""
    total = 0
    for group in wire.chunk_datums(_encode(batch)):
        for datum in wire.unpack_datums(wire.pack_datums(group)):
            total += datum.num_tokens
    return total


def _wire_roundtrip(batch) -> int:
    """What one request costs end to end: the client packs every chunk before it sends
    any (`pack_request`), gRPC serializes and parses each message, the server unpacks."""
    total = 0
    for chunk in wire.pack_request(_encode(batch)):
        parsed = training_pb2.ForwardChunk.FromString(chunk.SerializeToString())
        for datum in wire.unpack_datums(parsed.batch):
            total += datum.num_tokens
    return total


def _unchecked_roundtrip(batch) -> int:
    """The data movement of the codec alone: no checks, no Datum objects, no chunk sizing."""
    total = 0
    per_chunk = max(1, wire.DEFAULT_CHUNK_BYTES // (12 * SEQ_LEN))
    for start in range(0, len(batch), per_chunk):
        part = batch[start:start + per_chunk]
        message = training_pb2.ForwardChunk().batch
        message.input_ids.data = b"".join([ids.astype(np.int32) for ids, _, _ in part])
        message.loss_inputs["target_tokens"].data = b"".join(
            [targets.astype(np.int32) for _, targets, _ in part])
        message.loss_inputs["weights"].data = b"".join([weights for _, _, weights in part])
        ids = np.frombuffer(message.input_ids.data, "<i4")
        np.frombuffer(message.loss_inputs["target_tokens"].data, "<i4")
        np.frombuffer(message.loss_inputs["weights"].data, "<f4")
        total += ids.shape[0]
    return total


def main() -> None:
    batch = _batch()
    paths = {"plain numpy": _numpy_roundtrip, "codec": _codec_roundtrip,
             "codec + proto": _wire_roundtrip, "unchecked floor": _unchecked_roundtrip}
    seconds = best_per_call({name: functools.partial(fn, batch) for name, fn in paths.items()},
                            rounds=REPEATS)
    numpy_s = seconds["plain numpy"]
    mib = sum(a.nbytes // 2 + b.nbytes + c.nbytes for a, b, c in batch) / 2**20
    print(f"codec round trip: {NUM_DATUMS} datums x {SEQ_LEN} tokens ({mib:.1f} MiB), "
          f"best of {REPEATS} interleaved rounds")
    print(f"{'path':<16}{'seconds':>10}{'MiB/s':>10}{'vs numpy':>10}")
    for name, value in seconds.items():
        print(f"{name:<16}{value:>10.4f}{mib / value:>10.0f}{numpy_s / value:>9.2f}x")


if __name__ == "__main__":
    main()
