"""Real server processes for integration tests: start on port 0, wait for SERVING, stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from twinkle_client import wire
from twinkle_client._proto.twinkle.v1 import (
    common_pb2,
    runs_pb2,
    runs_pb2_grpc,
    sampling_pb2_grpc,
    session_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)

STARTUP_TIMEOUT_S = 120


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    address: str
    data_dir: Path
    log_path: Path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def log(self) -> str:
        return self.log_path.read_text()


def twinkle_server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twinkle_server.cli", *args],
                          capture_output=True, text=True, timeout=120)


def start_server(data_dir: Path, *extra: str) -> ServerProcess:
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / f"server-{time.time_ns()}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "twinkle_server.cli", "serve", "--port", "0",
         "--data-dir", str(data_dir), *extra],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    address = None
    while time.monotonic() < deadline and address is None:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log_path.read_text()}")
        match = re.search(r"^listening on (\S+)$", log_path.read_text(), re.M)
        address = match.group(1) if match else None
        time.sleep(0.1)
    if address is None:
        proc.kill()
        raise RuntimeError(f"server did not start:\n{log_path.read_text()}")
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=30)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    return ServerProcess(proc, address, data_dir, log_path)


class Client:
    """Thin raw-stub client for tests: one channel, optional API key."""

    def __init__(self, address: str, key: str | None = None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()
        self.session = session_pb2_grpc.SessionServiceStub(self.channel)
        self.training = training_pb2_grpc.TrainingServiceStub(self.channel)
        self.sampling = sampling_pb2_grpc.SamplingServiceStub(self.channel)
        self.runs = runs_pb2_grpc.RunsServiceStub(self.channel)
        self.seq: dict[str, int] = {}

    def call(self, method, request):
        return method(request, metadata=self.metadata, timeout=60)

    def create_model(self, rank: int = 4, seed: int = 0, **kw) -> str:
        lora = common_pb2.LoraConfig(rank=rank, seed=seed, train_mlp=True, train_attn=True,
                                     train_unembed=True)
        info = self.call(self.training.CreateModel,
                         training_pb2.CreateModelRequest(lora=lora, **kw))
        self.seq[info.model_id] = 0
        return info.model_id

    def header(self, model_id: str, seq: int | None = None) -> common_pb2.OpHeader:
        if seq is None:
            seq = self.seq[model_id]
            self.seq[model_id] = seq + 1
        return common_pb2.OpHeader(model_id=model_id, seq_id=seq)

    def forward_backward(self, model_id: str, datums, loss: str = "cross_entropy",
                         seq: int | None = None, backward: bool = True, chunk_bytes: int = 1 << 20):
        encoded = [d if isinstance(d, common_pb2.Datum) else wire.encode_datum(d[0], d[1], i)
                   for i, d in enumerate(datums)]
        header = training_pb2.ForwardHeader(op=self.header(model_id, seq),
                                            loss=common_pb2.LossFn(name=loss),
                                            num_datums=len(encoded))

        def chunks():
            yield training_pb2.ForwardChunk(header=header)
            for group in wire.chunk_datums(encoded, chunk_bytes):
                yield training_pb2.ForwardChunk(datums=group)
        method = self.training.ForwardBackward if backward else self.training.Forward
        results = list(method(chunks(), metadata=self.metadata, timeout=60))
        outputs = [wire.decode_array(o.outputs["logprobs"]) for r in results for o in r.outputs]
        return outputs, results[-1]

    def optim_step(self, model_id: str, lr: float = 1e-2, seq: int | None = None):
        return self.call(self.training.OptimStep, training_pb2.OptimStepRequest(
            op=self.header(model_id, seq),
            adam=training_pb2.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8)))

    def save(self, model_id: str, name: str, optimizer: bool = True, sampler: bool = False):
        request = training_pb2.SaveRequest(op=self.header(model_id), name=name,
                                           include_optimizer=optimizer)
        method = self.training.SaveWeightsForSampler if sampler else self.training.SaveState
        return self.call(method, request)

    def download(self, path: str, dest: Path) -> Path:
        dest.mkdir(parents=True, exist_ok=True)
        for chunk in self.runs.DownloadCheckpoint(runs_pb2.CheckpointRef(path=path),
                                                  metadata=self.metadata, timeout=120):
            with open(dest / chunk.path, "ab" if chunk.offset else "wb") as handle:
                handle.write(chunk.data)
        return dest


def toy_datums(n: int = 4, length: int = 12, vocab: int = 200, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, length + 1)
        out.append((ids[:-1], {"target_tokens": ids[1:],
                               "weights": np.ones(length, np.float32)}))
    return out
