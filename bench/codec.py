"""Codec throughput: 256 datums x 2048 tokens through `twinkle_client.wire` vs plain numpy.

Run: `.venv/bin/python -m bench.codec` (also part of `make bench`).

Both sides move the same arrays: input ids, target_tokens and weights to bytes and back.
Plain numpy does one `tobytes`/`frombuffer` per array and nothing else. The `codec` row
is the codec's whole work: validate each datum, chunk, pack each chunk into a
`DatumBatch`, then validate and split it back into datums; `codec + proto` adds what gRPC
does with each chunk message (serialize and parse). Ratios are throughput over plain
numpy throughput (1.0 = as fast as bare `tobytes`/`frombuffer`).
"""

from __future__ import annotations

import time

import numpy as np

from twinkle_client import wire
from twinkle_client._proto.twinkle.v1 import training_pb2

NUM_DATUMS = 256
SEQ_LEN = 2048
REPEATS = 5


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
    """Arrays -> validated datums -> packed chunk messages -> validated datums: the codec's work."""
    total = 0
    for group in wire.chunk_datums(_encode(batch)):
        for datum in wire.unpack_datums(wire.pack_datums(group)):
            total += datum.num_tokens
    return total


def _wire_roundtrip(batch) -> int:
    """The codec plus what gRPC adds: serializing and parsing each chunk message."""
    total = 0
    for group in wire.chunk_datums(_encode(batch)):
        chunk = training_pb2.ForwardChunk(batch=wire.pack_datums(group))
        parsed = training_pb2.ForwardChunk.FromString(chunk.SerializeToString())
        for datum in wire.unpack_datums(parsed.batch):
            total += datum.num_tokens
    return total


def _best_seconds(fn, batch) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn(batch)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    batch = _batch()
    numpy_s = _best_seconds(_numpy_roundtrip, batch)
    rows = [("plain numpy", numpy_s), ("codec", _best_seconds(_codec_roundtrip, batch)),
            ("codec + proto", _best_seconds(_wire_roundtrip, batch))]
    mib = sum(a.nbytes // 2 + b.nbytes + c.nbytes for a, b, c in batch) / 2**20
    print(f"codec round trip: {NUM_DATUMS} datums x {SEQ_LEN} tokens ({mib:.1f} MiB), "
          f"best of {REPEATS}")
    print(f"{'path':<16}{'seconds':>10}{'MiB/s':>10}{'vs numpy':>10}")
    for name, seconds in rows:
        print(f"{name:<16}{seconds:>10.4f}{mib / seconds:>10.0f}{numpy_s / seconds:>9.2f}x")


if __name__ == "__main__":
    main()
