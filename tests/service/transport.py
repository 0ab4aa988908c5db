"""The raw transports server tests and benchmarks drive the contract with.

- `Transport`: stubs of every service over one channel with API-key metadata and
  per-model seq counters; errors surface as raw `grpc.RpcError`s carrying the server's
  status code and message (`tests/service/harness.py` calls it `Client`; `bench.server`
  measures through it).
- `ProtoConnection`: the clients' `Connection` (typed errors, retries, session) plus the
  proto-level helpers the server tests write their requests with: op headers as
  messages, CreateModel from its request, Forward(Backward) over packed chunks.
"""

from __future__ import annotations

from pathlib import Path

import grpc

import twinkle_wire as wire
from twinkle_client import api
from twinkle_client.api.calls import op_header
from twinkle_client.connection import Connection, Op
from twinkle_wire._proto.twinkle.v1 import (
    common_pb2,
    runs_pb2,
    runs_pb2_grpc,
    sampling_pb2_grpc,
    session_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)

CALL_TIMEOUT_S = 60


class Transport:
    """Stubs of every service over one channel, with `authorization: Bearer <key>`."""

    def __init__(self, address: str, key: str | None = None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()
        self.session = session_pb2_grpc.SessionServiceStub(self.channel)
        self.training = training_pb2_grpc.TrainingServiceStub(self.channel)
        self.sampling = sampling_pb2_grpc.SamplingServiceStub(self.channel)
        self.runs = runs_pb2_grpc.RunsServiceStub(self.channel)
        self.seq: dict[str, int] = {}

    def call(self, method, request):
        """A unary call with this transport's metadata and deadline."""
        return method(request, metadata=self.metadata, timeout=CALL_TIMEOUT_S)

    def create_model(self, rank: int = 4, seed: int = 0, **kw) -> str:
        """A new LoRA model with Tinker's switches all on; returns its model id."""
        lora = common_pb2.LoraConfig(rank=rank, seed=seed, train_mlp=True, train_attn=True,
                                     train_unembed=True)
        info = self.call(self.training.CreateModel,
                         training_pb2.CreateModelRequest(lora=lora, **kw))
        self.seq[info.model_id] = 0
        return info.model_id

    def header(self, model_id: str, seq: int | None = None) -> common_pb2.OpHeader:
        """The next op header of `model_id` (or one with an explicit `seq`)."""
        if seq is None:
            seq = self.seq[model_id]
            self.seq[model_id] = seq + 1
        return common_pb2.OpHeader(model_id=model_id, seq_id=seq)

    def forward_backward(self, model_id: str, datums, loss: str = "cross_entropy",
                         seq: int | None = None, backward: bool = True,
                         chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES):
        """Stream `datums` ((ids, loss_inputs) pairs or `wire.Datum`s) in chunks; returns
        (per-datum logprobs, the final result chunk with loss and metrics)."""
        encoded = [d if isinstance(d, wire.Datum) else wire.encode_datum(d[0], d[1], i)
                   for i, d in enumerate(datums)]
        chunks = wire.pack_request(encoded, chunk_bytes)
        first = training_pb2.ForwardChunk(header=training_pb2.ForwardHeader(
            op=self.header(model_id, seq), loss=common_pb2.LossFn(name=loss),
            num_datums=len(encoded)))
        method = self.training.ForwardBackward if backward else self.training.Forward
        results = list(method(iter([first, *chunks]), metadata=self.metadata,
                              timeout=CALL_TIMEOUT_S))
        outputs = [wire.decode_array(o.outputs["logprobs"]) for r in results for o in r.outputs]
        return outputs, results[-1]

    def optim_step(self, model_id: str, lr: float = 1e-2, seq: int | None = None):
        """Tinker optim_step: AdamW at `lr` (betas 0.9/0.95, eps 1e-8)."""
        return self.call(self.training.OptimStep, training_pb2.OptimStepRequest(
            op=self.header(model_id, seq),
            adam=training_pb2.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8)))

    def save(self, model_id: str, name: str, optimizer: bool = True, sampler: bool = False):
        """SaveState (or SaveWeightsForSampler); returns the SaveResponse with the path."""
        request = training_pb2.SaveRequest(op=self.header(model_id), name=name,
                                           include_optimizer=optimizer)
        method = self.training.SaveWeightsForSampler if sampler else self.training.SaveState
        return self.call(method, request)

    def download(self, path: str, dest: Path) -> Path:
        """Write every file of checkpoint `path` under `dest`."""
        return api.write_files(self.runs.DownloadCheckpoint(
            runs_pb2.CheckpointRef(path=path), metadata=self.metadata, timeout=CALL_TIMEOUT_S),
            Path(dest))


class ProtoConnection(Connection):
    """A `Connection` whose helpers take and return protobuf messages, for tests that
    write requests by hand; failures raise the client's typed exceptions."""

    def op(self, model_id: str) -> common_pb2.OpHeader:
        """The header of `model_id`'s next op, as a message to put in a request."""
        return op_header(self.reserve(model_id))

    def create_model(self, request: training_pb2.CreateModelRequest) -> training_pb2.ModelInfo:
        """CreateModel under this session; registers the new model's seq counter."""
        if self.session_id and not request.session_id:
            request.session_id = self.session_id
        info = self.call(self.training.CreateModel, request, retry=False)
        self.register_model(info.model_id, info.next_seq_id)
        return info

    def forward(self, header: common_pb2.OpHeader, chunks: list[training_pb2.ForwardChunk],
                loss: common_pb2.LossFn | None = None, backward: bool = True
                ) -> api.ForwardResult:
        """Stream chunks packed by `wire.pack_request` as one Forward(Backward) op."""
        plain = None if loss is None else api.Loss(loss.name, dict(loss.config))
        op = Op(header.model_id, header.seq_id, header.request_id)
        return api.ForwardCall(chunks, plain, backward).send(self, op)

    def capabilities(self, refresh: bool = False) -> api.Capabilities:
        return api.capabilities(self, refresh)

    def download_checkpoint(self, path: str, dest) -> Path:
        return api.download_checkpoint(self, path, dest)
