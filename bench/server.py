"""Server benchmarks over loopback gRPC: remote overhead, empty-op latency, stream intake.

Run: `.venv/bin/python -m bench.server` (also part of `make bench`).

1. forward_backward + optim_step, 8 x 256 tokens, through a real server process vs the
   in-process engine in this process (same model, adapter shape and data).
2. Round trips over loopback, p50 / p99: GetServerCapabilities (the event loop) and
   GetTrainConfigs (an ordered op: the worker, and a store write of the run's last
   request time).
3. A 64 MiB batch of datums streamed to ForwardBackward in chunks under the default
   4 MiB message limit. The request names an unknown loss, so the server reads and
   decodes every chunk and then refuses it: the figure is upload + decode, not compute.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import twinkle_wire as wire
from bench.timing import best_per_call
from twinkle_client import api
from twinkle_client.connection import Connection
from twinkle_client.errors import InvalidArgumentError
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.types import AdamParams, Datum, LoraSpec, LossSpec
from twinkle_server.process import start_server

STEPS = 5


def _latency_ms(call: Callable[[], object], calls: int = 500, warmup: int = 50
                ) -> tuple[float, float]:
    """p50 and p99 of `calls` round trips after `warmup` unmeasured ones, in ms."""
    latencies = []
    for _ in range(warmup + calls):
        start = time.perf_counter()
        call()
        latencies.append((time.perf_counter() - start) * 1000)
    p50, p99 = np.percentile(latencies[warmup:], [50, 99])
    return float(p50), float(p99)


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
            conn = Connection(f"http://{server.address}", client_name="bench.server")
            model = api.create_model(lora=api.LoraSpec(4, seed=0, train_mlp=True,
                                                      train_attn=True, train_unembed=True)
                                     ).send(conn).model_id
            remote = [wire.encode_datum(ids, inputs, i) for i, (ids, inputs) in enumerate(batch)]
            adam = api.AdamParams(1e-2, 0.9, 0.95, 1e-8)

            def remote_step():
                api.submit(conn, model, api.forward(remote, api.Loss("cross_entropy"))).result()
                api.submit(conn, model, api.optim_step(adam)).result()

            print_overhead("remote overhead: forward_backward + optim_step, 8 x 256 tokens",
                           local_step, "gRPC loopback", remote_step, 8 * 256, "remote")

            rows = {"GetServerCapabilities (event loop)": lambda: api.capabilities(
                        conn, refresh=True),
                    "GetTrainConfigs (ordered op)": lambda: api.submit(
                        conn, model, api.get_train_configs()).result()}
            for label, call in rows.items():
                p50, p99 = _latency_ms(call)
                print(f"{label} round trip over loopback: p50 {p50:.2f} ms, p99 {p99:.2f} ms "
                      "(500 calls after 50 warm-up)")

            big = _data(2048, 2048, vocab, seed=1)
            # The datums' size with int64 targets (as Tinker builds them), so the figure
            # stays comparable across wire formats; the wire now carries them as int32.
            mib = sum(ids.size * 4 + inputs["target_tokens"].nbytes + inputs["weights"].nbytes
                      for ids, inputs in big) / 2**20
            wire_mib = sum(ids.size * 12 for ids, _ in big) / 2**20
            big_datums = [wire.encode_datum(ids, inputs, i) for i, (ids, inputs) in enumerate(big)]
            start = time.perf_counter()
            try:
                api.submit(conn, model, api.forward(big_datums, api.Loss("no_such_loss"))).result()
            except InvalidArgumentError:
                pass
            elapsed = time.perf_counter() - start
            print(f"stream intake: {mib:.0f} MiB of datums ({wire_mib:.0f} MiB on the "
                  f"wire) in {elapsed:.2f} s = {mib / elapsed:.0f} MiB/s of datums "
                  f"({wire.DEFAULT_CHUNK_BYTES // 1024} KiB chunks, default limits)")
            conn.close()
        finally:
            server.stop()


if __name__ == "__main__":
    main()
