"""Every gRPC op that carries a seq_id consumes it, whatever happens to it (issue 23, 2):
for each ordered op of the contract, a request refused before it runs, or failing in its
op, still takes its seq_id, so the model's next op runs. Each call has a deadline
(`transport.CALL_TIMEOUT_S`), so a seq_id hole fails here as DEADLINE_EXCEEDED instead of hanging.
The HTTP front's routes: tests/http/test_seq_ids.py."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from google.protobuf import struct_pb2

import twinkle_wire as wire
from twinkle_server.process import start_server
from twinkle_wire._proto.twinkle.v1 import (
    common_pb2,
    external_pb2,
    external_pb2_grpc,
    sampling_pb2,
    training_pb2,
)

from .harness import Client, toy_datums

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("seq-ids"), "--max-adapters-per-tenant", "32",
                        "--max-adapters", "32")
    transport = Client(proc.address)
    transport.external = external_pb2_grpc.ExternalWeightsServiceStub(transport.channel)
    yield transport
    proc.stop()


def _struct(**values) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(values)
    return out


def _odd_bytes() -> common_pb2.Tensor:
    """A token tensor whose bytes are not a whole number of int32s: refused on decode."""
    tokens = wire.encode_array(np.array([5, 6], np.int32))
    tokens.data = tokens.data[:-1]
    return tokens


# Each case: (stub attribute path, request built from the op header), the request bad
# in a way the server refuses at once or fails in the op.
CASES = {
    "OptimStep (not a number)": ("training.OptimStep", lambda op: training_pb2.OptimStepRequest(
        op=op, adam=training_pb2.AdamParams(learning_rate=float("nan")))),
    "SetOptimizer (unknown)": ("training.SetOptimizer", lambda op: training_pb2.ConfigureRequest(
        op=op, name="NoSuchOptimizer", kwargs=_struct())),
    "SetLrScheduler (unknown)": ("training.SetLrScheduler",
                                 lambda op: training_pb2.ConfigureRequest(
                                     op=op, name="NoSuchScheduler", kwargs=_struct())),
    "SetLoss (unknown)": ("training.SetLoss", lambda op: training_pb2.SetLossRequest(
        op=op, loss=common_pb2.LossFn(name="no_such_loss"))),
    "Step (no optimizer set)": ("training.Step", lambda op: training_pb2.OpRequest(op=op)),
    "SaveState (name)": ("training.SaveState", lambda op: training_pb2.SaveRequest(
        op=op, name="../up")),
    "SaveWeightsForSampler (name)": ("training.SaveWeightsForSampler",
                                     lambda op: training_pb2.SaveRequest(op=op, name="a/b")),
    "LoadState (path)": ("training.LoadState", lambda op: training_pb2.LoadStateRequest(
        op=op, path="twinkle://nowhere")),
    "LoadState (no such checkpoint)": ("training.LoadState",
                                       lambda op: training_pb2.LoadStateRequest(
                                           op=op, path="twinkle://run-000000000000/weights/x")),
    "SaveWeightsExternal (recipient)": ("external.SaveWeightsExternal",
                                        lambda op: external_pb2.SaveWeightsExternalRequest(
                                            op=op, name="x",
                                            age_encryption_recipients=["age1no"])),
    "SaveWeightsExternal (ttl)": ("external.SaveWeightsExternal",
                                  lambda op: external_pb2.SaveWeightsExternalRequest(
                                      op=op, name="x", ttl_seconds=5)),
    "Sample (prompt bytes)": ("sampling.Sample", lambda op: sampling_pb2.SampleRequest(
        op=op, prompt=_odd_bytes(), num_samples=1,
        params=sampling_pb2.SamplingParams(max_tokens=1))),
    "ComputeLogprobs (prompt bytes)": ("sampling.ComputeLogprobs",
                                       lambda op: sampling_pb2.ComputeLogprobsRequest(
                                           op=op, prompt=_odd_bytes())),
}


def _stub(client: Client, path: str):
    service, method = path.split(".")
    return getattr(getattr(client, service), method)


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_or_failed_op_takes_its_seq_id(client, case):
    path, build = CASES[case]
    model = client.create_model()
    client.forward_backward(model, toy_datums(2), backward=False)          # seq 0
    with pytest.raises(grpc.RpcError) as refused:
        client.call(_stub(client, path), build(client.header(model)))      # seq 1
    assert refused.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED, refused.value.details()
    client.forward_backward(model, toy_datums(2), backward=False)          # seq 2 runs
    client.call(client.training.UnloadModel, training_pb2.UnloadModelRequest(model_id=model))


@pytest.mark.parametrize("backward", [False, True])
def test_a_refused_forward_takes_its_seq_id(client, backward):
    model = client.create_model()
    with pytest.raises(grpc.RpcError, match="no_such_loss"):
        client.forward_backward(model, toy_datums(2), loss="no_such_loss", backward=backward)
    client.forward_backward(model, toy_datums(2), backward=backward)
    client.call(client.training.UnloadModel, training_pb2.UnloadModelRequest(model_id=model))


def test_every_ordered_rpc_has_a_case():
    """A new ordered op (one whose request carries an OpHeader) needs a case above."""
    covered = {path.split(".")[1] for path, _ in CASES.values()} | {
        "Forward", "ForwardBackward",                                # the test above
        "ZeroGrad", "LrStep", "ClipGradNorm", "CalculateMetric", "GetTrainConfigs", "SkipSeq",
    }   # these six take no input that can be wrong: they run and consume their seq_id
    ordered = set()
    for module in (training_pb2, sampling_pb2, external_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                fields = method.input_type.fields_by_name
                header = fields.get("op") or fields.get("header")
                if header is not None and header.message_type.name in ("OpHeader",
                                                                       "ForwardHeader"):
                    ordered.add(method.name)
                if method.input_type.name == "ForwardChunk":
                    ordered.add(method.name)
    assert ordered <= covered, sorted(ordered - covered)
