"""Hostile input against a real server: random and mutated protobuf bytes sent to every
RPC, and a catalogue of named attacks, each with its expected status.

The server must answer every message with a status (never crash, never hang past the
call deadline) and keep serving good requests from the same tenant afterwards.
"""

from __future__ import annotations

import random

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import twinkle_wire as wire
from twinkle_client import errors
from twinkle_server.process import start_server
from twinkle_server.server import SERVICES
from twinkle_wire._proto.twinkle.v1 import (
    common_pb2,
    runs_pb2,
    sampling_pb2,
    training_pb2,
)

from .harness import send_batch
from .transport import ProtoConnection as Connection

pytestmark = pytest.mark.integration

HANG_S = 30.0
"""A call that takes longer than this on the tiny model counts as a hang."""



def _methods() -> list[tuple[str, bool, bool]]:
    """(full path, client-streaming, server-streaming) of every RPC in the contract."""
    out = []
    for service in SERVICES:
        for method in service.methods:
            out.append((f"/{service.full_name}/{method.name}", method.client_streaming,
                        method.server_streaming))
    return out


METHODS = _methods()


@pytest.fixture(scope="module")
def target(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("hostile"), "--max-seq-len", "128",
                        "--max-batch-tokens", "4096")
    conn = Connection(proc.address, client_name="test")
    model = conn.create_model(training_pb2.CreateModelRequest(lora=common_pb2.LoraConfig(
        rank=4, seed=0, train_mlp=True, train_attn=True))).model_id
    channel = grpc.insecure_channel(proc.address)
    yield proc, conn, model, channel
    channel.close()
    conn.close()
    proc.stop()


def _send(channel: grpc.Channel, path: str, client_stream: bool, server_stream: bool,
          payload: bytes) -> tuple[grpc.StatusCode, str]:
    """Send raw bytes as the request; return the status and details the server answered."""
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    call = kind[(client_stream, server_stream)](path)
    request = iter([payload, payload]) if client_stream else payload
    try:
        response = call(request, timeout=HANG_S)
        if server_stream:
            for _ in response:
                pass
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


def _answered(code: grpc.StatusCode, details: str) -> bool:
    """A deliberate answer: any status but a hang, or an UNKNOWN other than gRPC's own
    refusal of bytes that do not parse (a handler that raised past the error mapping)."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return False
    return code != grpc.StatusCode.UNKNOWN or "deserializ" in details.lower()


def _good_step(conn: Connection, model: str) -> None:
    ids = np.arange(5, 17)
    datum = wire.encode_datum(ids, {"target_tokens": ids + 1,
                                    "weights": np.ones(12, np.float32)})
    result = conn.forward(conn.op(model), wire.pack_request([datum]),
                          common_pb2.LossFn(name="cross_entropy"))
    assert np.isfinite(result.loss)


def _valid_messages(model: str) -> list[tuple[int, bytes]]:
    """Well-formed messages for a few RPCs, as seeds to mutate: (method index, bytes)."""
    ids = np.arange(5, 15)
    datum = wire.encode_datum(ids, {"target_tokens": ids + 1, "weights": np.ones(10, np.float32)})
    header = training_pb2.ForwardChunk(header=training_pb2.ForwardHeader(
        op=common_pb2.OpHeader(model_id=model, seq_id=10**6), num_datums=1,
        loss=common_pb2.LossFn(name="cross_entropy")), batch=wire.pack_datums([datum]))
    sample = sampling_pb2.SampleRequest(
        op=common_pb2.OpHeader(model_id=model, seq_id=10**6), num_samples=2,
        prompt=wire.encode_array(ids), params=sampling_pb2.SamplingParams(max_tokens=4))
    index = {path.rsplit("/", 1)[1]: i for i, (path, _, _) in enumerate(METHODS)}
    return [(index["Forward"], header.SerializeToString()),
            (index["Sample"], sample.SerializeToString()),
            (index["CreateModel"], training_pb2.CreateModelRequest(
                lora=common_pb2.LoraConfig(rank=4, train_attn=True)).SerializeToString()),
            (index["ListCheckpoints"], runs_pb2.ListCheckpointsRequest(
                limit=5).SerializeToString())]


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(which=st.integers(0, len(METHODS) - 1), payload=st.binary(max_size=512))
def test_random_bytes_to_any_rpc_get_a_status_and_never_a_hang(target, which, payload):
    proc, _, _, channel = target
    path, client_stream, server_stream = METHODS[which]
    code, details = _send(channel, path, client_stream, server_stream, payload)
    assert _answered(code, details), f"{path} on {payload!r}: {code} {details}"
    assert proc.proc.poll() is None


def test_mutated_valid_messages_get_a_status_and_the_server_keeps_serving(target):
    proc, conn, model, channel = target
    rng = random.Random(1234)
    for seed_index, seed in _valid_messages(model):
        path, client_stream, server_stream = METHODS[seed_index]
        for _ in range(40):
            data = bytearray(seed)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            code, details = _send(channel, path, client_stream, server_stream, bytes(data))
            assert _answered(code, details), f"{path} on {bytes(data)!r}: {code} {details}"
    assert proc.proc.poll() is None
    # Mutants may have created models; whatever they did, the original model still trains.
    _good_step(conn, model)


def _datum_with(ids=None, **loss_inputs) -> wire.Datum:
    ids = np.arange(5, 15) if ids is None else ids
    return wire.encode_datum(ids, loss_inputs or {"target_tokens": ids + 1})


def _catalogue(conn: Connection, model: str) -> list[tuple[str, object, type, str]]:
    """(case, callable, expected exception class, text the message must contain)."""
    fb = common_pb2.LossFn(name="cross_entropy")

    def batch() -> common_pb2.DatumBatch:
        return wire.pack_datums([_datum_with()])

    def raw(bad: common_pb2.DatumBatch, declared: int | None = None):
        def send():
            try:
                send_batch(conn.training.ForwardBackward, conn.op(model), bad, conn.metadata,
                           num_datums=declared)
            except grpc.RpcError as exc:
                raise errors.from_rpc_error(exc, "ForwardBackward") from None
        return send

    huge = batch()
    huge.input_ids.shape[:] = [2**40]
    negative = batch()
    negative.loss_inputs["target_tokens"].shape[:] = [-10]
    wrong_dtype = batch()
    wrong_dtype.input_ids.dtype = common_pb2.FLOAT32
    unknown_dtype = batch()
    unknown_dtype.input_ids.dtype = 99
    overlong = batch()
    overlong.lengths[:] = [2**62, 2**62]
    negative_length = batch()
    negative_length.lengths[:] = [11, -1]
    empty_but_huge = batch()
    empty_but_huge.loss_inputs["weights"].CopyFrom(common_pb2.Tensor(
        dtype=common_pb2.FLOAT32, shape=[10, 0, 2**62, 2**62]))

    def too_many():
        try:
            send_batch(conn.training.ForwardBackward, conn.op(model),
                       wire.pack_datums([_datum_with(), _datum_with()]), conn.metadata,
                       num_datums=1)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc, "ForwardBackward") from None
    ids = np.arange(5, 15)

    def lengths_only(declared: int):
        batch = common_pb2.DatumBatch(lengths=[1] * 10**6)
        batch.input_ids.CopyFrom(wire.encode_array(np.zeros(0, np.int32)))
        return raw(batch, declared)

    def forward(*datums, loss=fb):
        def send():
            chunks = wire.pack_request(list(datums))
            return conn.forward(conn.op(model), chunks, loss)
        return send

    return [
        ("huge declared shape, tiny payload", raw(huge), errors.InvalidArgumentError,
         "input_ids"),
        ("negative dimension", raw(negative), errors.InvalidArgumentError, "target_tokens"),
        ("float token ids", raw(wrong_dtype), errors.InvalidArgumentError, "dtype"),
        ("unknown dtype tag", raw(unknown_dtype), errors.InvalidArgumentError, "dtype"),
        ("lengths past the payload", raw(overlong), errors.InvalidArgumentError,
         "do not add up"),
        ("negative length", raw(negative_length), errors.InvalidArgumentError, "negative"),
        ("empty tensor with dimensions numpy cannot index", raw(empty_but_huge),
         errors.InvalidArgumentError, "too large to index"),
        ("more datums than the header declares", too_many, errors.InvalidArgumentError,
         "header says 1 but 2 datums arrived"),
        ("70-dimension prompt on an ordered sample", lambda: conn.call(
            conn.sampling.Sample, sampling_pb2.SampleRequest(
                op=conn.op(model), prompt=common_pb2.Tensor(
                    dtype=common_pb2.INT32, shape=[1] * 70, data=b"\0" * 4),
                num_samples=1, params=sampling_pb2.SamplingParams(max_tokens=2))),
         errors.InvalidArgumentError, "at most 8"),
        ("token id at INT32 max", forward(_datum_with(
            np.array([5, 2**31 - 1]), target_tokens=np.array([6, 7]))),
         errors.InvalidArgumentError, "outside the vocabulary"),
        ("0-length sequence", forward(_datum_with(np.zeros(0, np.int64),
                                                  target_tokens=np.zeros(0, np.int64))),
         errors.InvalidArgumentError, "empty"),
        # Both are refused by their count before the chunk is decoded: decoding it would
        # have failed on its lengths instead.
        ("10^6 datums in one chunk under a header declaring 2", lengths_only(2),
         errors.InvalidArgumentError, "num_datums: header says 2 but 1000000 datums arrived"),
        ("a header declaring more datums than a request has tokens", lengths_only(10**9),
         errors.InvalidArgumentError, "num_datums: 1000000000 datums need more than"),
        ("a header declaring -1 datums", lengths_only(-1), errors.InvalidArgumentError,
         "num_datums: must not be negative, got -1"),
        ("10^6 datums", forward(*[_datum_with(np.array([5]), target_tokens=np.array([6]))]
                                * 10**6), errors.InvalidArgumentError, "--max-batch-tokens"),
        ("checkpoint name with path tricks", lambda: conn.call(
            conn.training.SaveState, training_pb2.SaveRequest(op=conn.op(model),
                                                              name="..%2f..%2fetc")),
         errors.InvalidArgumentError, "not a valid checkpoint name"),
        ("unicode checkpoint name", lambda: conn.call(
            conn.training.SaveState, training_pb2.SaveRequest(op=conn.op(model), name="模型\u202e")),
         errors.InvalidArgumentError, "not a valid checkpoint name"),
        ("path with traversal", lambda: conn.call(conn.runs.GetCheckpoint, runs_pb2.CheckpointRef(
            path=f"twinkle://{model}/weights/../../twinkle.db")),
         errors.InvalidArgumentError, "path"),
        ("NaN in weights", forward(_datum_with(ids, target_tokens=ids + 1, weights=np.full(
            10, np.nan, np.float32))), errors.InvalidArgumentError,
         "loss_fn_inputs['weights']: contains NaN or infinity"),
        ("inf in advantages", forward(_datum_with(
            ids, target_tokens=ids + 1, logprobs=np.full(10, -1.0, np.float32),
            advantages=np.full(10, np.inf, np.float32)),
            loss=common_pb2.LossFn(name="importance_sampling")),
         errors.InvalidArgumentError, "loss_fn_inputs['advantages']: contains NaN or infinity"),
        ("oversized run metadata", lambda: conn.call(
            conn.training.CreateModel, training_pb2.CreateModelRequest(
                lora=common_pb2.LoraConfig(rank=4, train_attn=True),
                user_metadata={"note": "x" * 100_000}), retry=False),
         errors.InvalidArgumentError, "user_metadata: 1 entries, 100004 bytes"),
        ("oversized checkpoint metadata", lambda: conn.call(
            conn.training.SaveState, training_pb2.SaveRequest(
                op=conn.op(model), name="meta", user_metadata={
                    f"k{i}": "v" for i in range(1000)})),
         errors.InvalidArgumentError, "at most 64 entries"),
        ("sample with a huge max_tokens", lambda: conn.call(
            conn.sampling.Sample, sampling_pb2.SampleRequest(
                op=conn.op(model), prompt=wire.encode_array(ids), num_samples=1,
                params=sampling_pb2.SamplingParams(max_tokens=2**31 - 1))),
         errors.InvalidArgumentError, "max_tokens"),
        ("float prompt on an ordered sample", lambda: conn.call(
            conn.sampling.Sample, sampling_pb2.SampleRequest(
                op=conn.op(model), prompt=wire.encode_array(np.array([5.7, 6.0], np.float32)),
                num_samples=1, params=sampling_pb2.SamplingParams(max_tokens=2))),
         errors.InvalidArgumentError, "prompt: dtype must be INT32 or INT64, got FLOAT32"),
        ("negative prompt token in compute_logprobs", lambda: conn.call(
            conn.sampling.ComputeLogprobs, sampling_pb2.ComputeLogprobsRequest(
                op=conn.op(model), prompt=wire.encode_array(np.array([5, -6])))),
         errors.InvalidArgumentError, "prompt: token ids must be non-negative, found -6"),
        # The message echoes the name; whole, it once passed gRPC's 8 KiB metadata
        # limit and the client got "Stream removed" instead of the field's error.
        ("a 20,000-character checkpoint name", lambda: conn.call(
            conn.training.SaveState, training_pb2.SaveRequest(op=conn.op(model),
                                                              name="模" * 20_000)),
         errors.InvalidArgumentError, "not a valid checkpoint name"),
        ("sample with a huge num_samples", lambda: conn.call(
            conn.sampling.Sample, sampling_pb2.SampleRequest(
                op=conn.op(model), prompt=wire.encode_array(ids), num_samples=2**31 - 1,
                params=sampling_pb2.SamplingParams(max_tokens=4))),
         errors.InvalidArgumentError, "num_samples"),
    ]


def test_catalogue_of_named_attacks_each_gets_its_status(target):
    _, conn, model, _ = target
    for case, attempt, expected, text in _catalogue(conn, model):
        with pytest.raises(errors.TwinkleError) as caught:
            attempt()
        assert isinstance(caught.value, expected), f"{case}: {caught.value!r}"
        assert text in str(caught.value), f"{case}: {caught.value}"
        _good_step(conn, model)


def test_a_stream_short_of_its_header_does_not_run_and_its_seq_id_can_be_retried(target):
    _, conn, model, _ = target
    header = conn.op(model)
    datums = [_datum_with(), _datum_with()]
    with pytest.raises(grpc.RpcError) as caught:
        send_batch(conn.training.ForwardBackward, header, wire.pack_datums(datums),
                   conn.metadata, num_datums=3)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header says 3 but 2 datums arrived; the op did not run" in caught.value.details()
    # Nothing ran and the seq_id is still free: the whole op under it goes through.
    result = conn.forward(header, wire.pack_request(datums),
                          common_pb2.LossFn(name="cross_entropy"))
    assert np.isfinite(result.loss) and len(result.outputs) == 2
    _good_step(conn, model)
