"""Test helpers: real server processes and the raw transport, plus toy data."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

import twinkle_wire as wire
from twinkle_server.process import ServerProcess, start_server  # noqa: F401
from twinkle_wire._proto.twinkle.v1 import common_pb2, training_pb2

from .transport import Transport as Client  # noqa: F401


def twinkle_server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twinkle_server.cli", *args],
                          capture_output=True, text=True, timeout=120)


def toy_datums(n: int = 4, length: int = 12, vocab: int = 200, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, length + 1)
        out.append((ids[:-1], {"target_tokens": ids[1:],
                               "weights": np.ones(length, np.float32)}))
    return out


def packed_datums(n: int = 2, length: int = 8, seed: int = 0) -> list:
    """`toy_datums` packed as stream chunks, for tests that drive `transport.ProtoConnection`."""
    return wire.pack_request([wire.encode_datum(ids, inputs, i)
                              for i, (ids, inputs) in enumerate(toy_datums(n, length, seed=seed))])


def send_batch(stub, header: common_pb2.OpHeader, batch: common_pb2.DatumBatch,
               metadata=(), loss: str = "cross_entropy", num_datums: int | None = None
               ) -> list:
    """Stream `batch` exactly as built (past every client check) as one Forward(Backward)
    op, for tests of the server's own validation; raises the call's `grpc.RpcError`.
    `num_datums` is what the header declares (by default, what the batch holds)."""
    declared = len(batch.lengths) if num_datums is None else num_datums
    messages = [training_pb2.ForwardChunk(header=training_pb2.ForwardHeader(
                    op=header, loss=common_pb2.LossFn(name=loss), num_datums=declared)),
                training_pb2.ForwardChunk(batch=batch)]
    return list(stub(iter(messages), metadata=metadata, timeout=60))


def small_lora(rank: int = 4) -> common_pb2.LoraConfig:
    """A seeded LoRA on attention and MLP layers: quick to create and to train."""
    return common_pb2.LoraConfig(rank=rank, seed=0, train_mlp=True, train_attn=True)


def create_key(data_dir, tenant: str) -> str:
    """A new API key for `tenant` in `data_dir`, through the CLI."""
    out = twinkle_server("keys", "create", "--tenant", tenant, "--data-dir", str(data_dir))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]
