"""Server benchmarks over loopback gRPC: remote overhead, empty-op latency, stream intake.

Run: `.venv/bin/python -m bench.server` (also part of `make bench`).

1. forward_backward + optim_step, 8 x 256 tokens, through a real server process vs the
   in-process engine in this process (same model, adapter shape and data).
2. GetInfo round trips: p50 / p99 latency.
3. A 64 MiB batch of datums streamed to ForwardBackward in chunks under the default
   4 MiB message limit. The request names an unknown loss, so the server reads and
   decodes every chunk and then refuses it: the figure is upload + decode, not compute.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from bench.timing import best_per_call
from tests.server.transport import Transport
from twinkle_client import wire
from twinkle_client._proto.twinkle.v1 import training_pb2
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.types import AdamParams, Datum, LoraSpec, LossSpec
from twinkle_server.process import start_server

STEPS = 5


def _data(n: int, length: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, length + 1)
        out.append((ids[:-1], {"target_tokens": ids[1:], "weights": np.ones(length, np.float32)}))
    return out


def print_overhead(title: str, local_step: Callable[[], None], name: str,
                   remote_step: Callable[[], None], tokens: int, label: str) -> None:
    """Time a remote step against the in-process one side by side and print the table."""
    timings = best_per_call({"in-process engine": local_step, name: remote_step},
                            rounds=2, calls=STEPS, warmup=True)
    print(title)
    for row, per in timings.items():
        print(f"  {row:<20}{per:>8.4f} s/step{tokens / per:>10.0f} tokens/s")
    print(f"  {label} / in-process throughput: "
          f"{timings['in-process engine'] / timings[name]:.2f}x")


def main() -> None:
    engine = Engine.load("tiny")
    vocab = engine.base.vocab_size
    batch = _data(8, 256, vocab)
    engine.add_adapter("local", LoraSpec.from_tinker(rank=4, seed=0))
    datums = [Datum(ids, inputs) for ids, inputs in batch]

    def local_step():
        engine.forward_batch([ForwardRequest("local", datums, LossSpec("cross_entropy"), True)])
        engine.optim_step("local", AdamParams(learning_rate=1e-2, eps=1e-8))

    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), "--max-batch-tokens", "8000000")
        try:
            client = Transport(server.address)
            model = client.create_model(rank=4, seed=0)

            def remote_step():
                client.forward_backward(model, batch)
                client.optim_step(model)

            print_overhead("remote overhead: forward_backward + optim_step, 8 x 256 tokens",
                           local_step, "gRPC loopback", remote_step, 8 * 256, "remote")

            request = training_pb2.GetInfoRequest(model_id=model)
            latencies = []
            for _ in range(500):
                start = time.perf_counter()
                client.call(client.training.GetInfo, request)
                latencies.append((time.perf_counter() - start) * 1000)
            p50, p99 = np.percentile(latencies[50:], [50, 99])
            print(f"GetInfo round trip over loopback: p50 {p50:.2f} ms, p99 {p99:.2f} ms "
                  "(450 calls after 50 warm-up)")

            big = _data(2048, 2048, vocab, seed=1)
            # The datums' size with int64 targets (as Tinker builds them), so the figure
            # stays comparable across wire formats; the wire now carries them as int32.
            mib = sum(ids.size * 4 + inputs["target_tokens"].nbytes + inputs["weights"].nbytes
                      for ids, inputs in big) / 2**20
            wire_mib = sum(ids.size * 12 for ids, _ in big) / 2**20
            start = time.perf_counter()
            try:
                client.forward_backward(model, big, loss="no_such_loss")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            elapsed = time.perf_counter() - start
            print(f"stream intake: {mib:.0f} MiB of datums ({wire_mib:.0f} MiB on the "
                  f"wire) in {elapsed:.2f} s = {mib / elapsed:.0f} MiB/s of datums "
                  f"({wire.DEFAULT_CHUNK_BYTES // 1024} KiB chunks, default limits)")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
