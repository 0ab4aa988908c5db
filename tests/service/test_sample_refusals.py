"""A bad sampling parameter over gRPC: INVALID_ARGUMENT naming the field and its limit, at
once (`runtime.sampling` checks each rule before anything is queued), on a sampling
session and on a live model's ordered op; an ordered op refused so still takes its seq_id.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

import twinkle_wire as wire
from twinkle_server.process import start_server
from twinkle_wire._proto.twinkle.v1 import sampling_pb2

from .harness import Client

pytestmark = pytest.mark.integration
VOCAB = 4096          # the tiny model's
MAX_SEQ_LEN = 128     # the server's --max-seq-len below
AT_ONCE_S = 10.0
"""A refusal answered later than this counts as queued: the ordered case waits on a seq_id
that is never sent, so a refusal that waited for its turn would not come at all."""


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("refusals"), "--max-seq-len",
                        str(MAX_SEQ_LEN), "--max-batch-tokens", "4096")
    yield Client(proc.address)
    proc.stop()


@pytest.fixture(scope="module")
def session(client) -> str:
    return client.call(client.sampling.CreateSamplingSession,
                       sampling_pb2.CreateSamplingSessionRequest(base_model="tiny")
                       ).sampling_session_id


def _request(prompt=(5, 6, 7), num_samples: int = 1, **params) -> sampling_pb2.SampleRequest:
    return sampling_pb2.SampleRequest(
        prompt=wire.encode_array(np.asarray(prompt, np.int32)), num_samples=num_samples,
        params=sampling_pb2.SamplingParams(**{"max_tokens": 2, **params}))


BAD = [
    ({"top_p": 1.5}, 1, (5, 6), "sampling_params.top_p: must be in (0, 1], got 1.5"),
    ({"temperature": -1.0}, 1, (5, 6), "sampling_params.temperature: must be finite and >= 0"),
    ({"top_k": -2}, 1, (5, 6), "sampling_params.top_k: must be >= 0 (or -1 = no limit)"),
    ({"max_tokens": MAX_SEQ_LEN}, 1, (5, 6),
     f"over the {MAX_SEQ_LEN}-token limit (--max-seq-len)"),
    ({}, 10**4, (5, 6), "num_samples: 10000 x (prompt + max_tokens)"),
    ({}, 1, (5, VOCAB), f"prompt: token ids must lie in [0, {VOCAB})"),
    ({}, 1, (), "prompt: is empty"),
]


@pytest.mark.parametrize(("params", "num_samples", "prompt", "says"), BAD,
                         ids=[f"{p}-{n}-{len(t)}" for p, n, t, _ in BAD])
def test_a_bad_parameter_on_a_session_is_invalid_argument(client, session, params,
                                                          num_samples, prompt, says):
    request = _request(prompt, num_samples, **params)
    request.sampling_session_id = session
    with pytest.raises(grpc.RpcError) as caught:
        client.call(client.sampling.Sample, request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert says in caught.value.details()


def test_an_ordered_refusal_comes_at_once_and_takes_its_seq_id(client):
    model = client.create_model()
    skipped = client.header(model)          # never sent: seq 1 waits on it
    request = _request(temperature=-1.0)
    request.op.CopyFrom(client.header(model))
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        client.call(client.sampling.Sample, request)
    assert time.monotonic() - started < AT_ONCE_S
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.temperature" in caught.value.details()
    # Seq 0 then 2 run: the refused seq 1 was consumed, not left as a hole.
    good = _request(seed=0)
    good.op.CopyFrom(skipped)
    assert len(client.call(client.sampling.Sample, good).sequences) == 1
    after = _request(seed=0)
    after.op.CopyFrom(client.header(model))
    assert len(client.call(client.sampling.Sample, after).sequences) == 1
