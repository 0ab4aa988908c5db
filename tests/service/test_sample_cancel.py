"""A gRPC client that cancels its Sample call (or goes away) stops the request in the
decode pool (issue 30, fault 6); an ordered sample still takes its seq_id, and a retry of
it is told it was cancelled. The pool is watched through the HTTP front's `/metrics`."""

from __future__ import annotations

import time

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import twinkle_wire as wire
from twinkle_client import errors
from twinkle_wire._proto.twinkle.v1 import sampling_pb2

from .harness import Client, start_server, toy_datums

pytestmark = pytest.mark.integration
MAX_TOKENS = 600
STARTED_TOKENS = 8
"""Tokens the request must have decoded before it is cancelled: it is in the pool."""
STOPPED_WITHIN_TOKENS = 150
"""Most tokens the pool may decode after the cancel: a 100 ms slice of one row, with room
to spare (before the fix, the rest of the 600)."""
WAIT_SECONDS = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("grpc-cancel"), http=True)
    yield proc
    proc.stop()


def _metric(server, name: str, **labels: str) -> float:
    text = httpx.get(f"http://{server.http_address}/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _cancel_once_decoding(server, call) -> tuple[float, float]:
    """Cancel `call` once the pool decoded `STARTED_TOKENS` more; returns the pool's token
    count then, and once it stopped growing."""
    before = _metric(server, "twinkle_decode_tokens_total")
    deadline = time.monotonic() + WAIT_SECONDS
    while (at_cancel := _metric(server, "twinkle_decode_tokens_total")) < before + STARTED_TOKENS:
        assert time.monotonic() < deadline, "the sample never started decoding"
        time.sleep(0.005)
    assert call.cancel()
    last = at_cancel
    while True:   # no rows left, and no token for half a second
        time.sleep(0.5)
        now = _metric(server, "twinkle_decode_tokens_total")
        if now == last and _metric(server, "twinkle_decode_rows_active") == 0:
            return at_cancel, now
        assert time.monotonic() < deadline, "the pool kept decoding"
        last = now


def _until(ready) -> None:
    """Wait (at most WAIT_SECONDS) until `ready()`: a counter the server bumps when it
    answers may come a moment after the answer."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not ready():
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.05)


def _endless(**fields) -> sampling_pb2.SampleRequest:
    return sampling_pb2.SampleRequest(
        prompt=wire.encode_array(np.array([5, 6, 7, 8], np.int64)), num_samples=1,
        params=sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0,
                                           seed=3, ignore_eos=True), **fields)


def test_a_cancelled_sample_call_leaves_the_pool_at_the_next_step(server):
    client = Client(server.address)
    session = client.call(client.sampling.CreateSamplingSession,
                          sampling_pb2.CreateSamplingSessionRequest(base_model="tiny"))
    cancelled = _metric(server, "twinkle_ops_total", kind="sample", outcome="cancelled")
    call = client.sampling.Sample.future(
        _endless(sampling_session_id=session.sampling_session_id), timeout=WAIT_SECONDS)
    at_cancel, stopped = _cancel_once_decoding(server, call)
    assert stopped - at_cancel < STOPPED_WITHIN_TOKENS, (at_cancel, stopped)
    assert _metric(server, "twinkle_decode_rows_active") == 0
    _until(lambda: _metric(server, "twinkle_ops_total", kind="sample",
                           outcome="cancelled") == cancelled + 1)


def test_a_cancelled_ordered_sample_takes_its_seq_id_and_a_retry_is_told_it_was_cancelled(
        server):
    client = Client(server.address)
    model = client.create_model(seed=2)
    request = _endless(op=client.header(model))
    call = client.sampling.Sample.future(request, timeout=WAIT_SECONDS)
    at_cancel, stopped = _cancel_once_decoding(server, call)
    assert stopped - at_cancel < STOPPED_WITHIN_TOKENS, (at_cancel, stopped)
    # The model's next op runs: the cancelled sample did not leave a hole in the order.
    _, result = client.forward_backward(model, toy_datums(1))
    assert np.isfinite(result.loss)
    with pytest.raises(grpc.RpcError) as failure:
        client.call(client.sampling.Sample, request)
    assert failure.value.code() == grpc.StatusCode.CANCELLED
    error = errors.from_rpc_error(failure.value, "Sample")
    assert isinstance(error, errors.CancelledError) and "seq_id 0" in str(error)
