"""Cancelling a sample over HTTP (issue 30, fault 6): the stock SDK's `cancel_future`
stops the request in the decode pool at its next step, measured by the pool's own
`twinkle_decode_tokens` counter, and the request's result says it was cancelled.

A server of its own, so a pool left in a bad state by a failure here cannot fail the
package's other tests."""

from __future__ import annotations

import time

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from twinkle_server.process import start_server

from ..service.harness import create_key

pytestmark = pytest.mark.integration
PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 600
# Sample without stopping at EOS (Tinker's `stop=[]`): only max_tokens or a cancel end it.
ENDLESS = types.SamplingParams(max_tokens=MAX_TOKENS, stop=[], seed=3, temperature=1.0)
STARTED_TOKENS = 8
"""Tokens the request must have decoded before it is cancelled: it is in the pool."""
STOPPED_WITHIN_TOKENS = 150
"""Most tokens the pool may still decode after the cancel is answered: a 100 ms decode
slice of one row, with room to spare. Before the fix it decoded the rest of the 600
(373-468 tokens after the cancel)."""
WAIT_SECONDS = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    data_dir = tmp_path_factory.mktemp("http-cancel")
    key = create_key(data_dir, "alice")
    proc = start_server(data_dir, http=True)
    proc.key = key
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"http://{server.http_address}"


@pytest.fixture(scope="module")
def service(server, base_url):
    client = tinker.ServiceClient(base_url=base_url, api_key=server.key)
    yield client
    client.close("success").result()


@pytest.fixture
def http(server, base_url):
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.key},
                      timeout=WAIT_SECONDS) as client:
        yield client


def _metric(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _decoded(base_url: str) -> float:
    return _metric(base_url, "twinkle_decode_tokens_total")


def _wait_decoding(base_url: str, since: float) -> float:
    """The pool's token count once the request has decoded `STARTED_TOKENS`."""
    deadline = time.monotonic() + WAIT_SECONDS
    while (now := _decoded(base_url)) < since + STARTED_TOKENS:
        assert time.monotonic() < deadline, "the sample never started decoding"
        time.sleep(0.005)
    return now


def _wait_still(base_url: str) -> float:
    """The pool's token count once it holds no rows and stopped growing for half a second
    (a busy machine may pause the pool that long with a row still in it)."""
    deadline = time.monotonic() + WAIT_SECONDS
    last = _decoded(base_url)
    while True:
        time.sleep(0.5)
        now = _decoded(base_url)
        if now == last and _metric(base_url, "twinkle_decode_rows_active") == 0:
            return now
        assert time.monotonic() < deadline, "the pool kept decoding"
        last = now


def _until(ready) -> None:
    """Wait (at most WAIT_SECONDS) until `ready()`: a counter the server bumps when it
    answers may come a moment after the answer."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not ready():
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.05)


def test_the_sdk_is_told_it_may_cancel_samples(http):
    assert http.post("/api/v1/client/dynamic_config", json={}).json()[
        "sample_cancel_enabled"] is True


def test_cancel_future_stops_the_sample_at_the_next_step_and_its_result_says_cancelled(
        http, service, base_url):
    session = http.post("/api/v1/create_sampling_session",
                        json={"base_model": "tiny"}).json()["sampling_session_id"]
    before = _decoded(base_url)
    cancelled_before = _metric(base_url, "twinkle_ops_total", kind="sample",
                               outcome="cancelled")
    request_id = http.post("/api/v1/asample", json={
        "sampling_session_id": session, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": ENDLESS.model_dump()}).json()["request_id"]
    at_cancel = _wait_decoding(base_url, before)
    assert http.post("/api/v1/cancel_future", json={"request_id": request_id}).is_success
    answered = _decoded(base_url)
    stopped = _wait_still(base_url)
    assert stopped - answered < STOPPED_WITHIN_TOKENS, (before, at_cancel, answered, stopped)
    assert stopped - before < MAX_TOKENS
    failed = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
    assert "cancelled" in failed["error"] and failed["category"] == "user"
    _until(lambda: _metric(base_url, "twinkle_ops_total", kind="sample",
                           outcome="cancelled") == cancelled_before + 1)
    assert _metric(base_url, "twinkle_decode_rows_active") == 0
    # The pool serves the next request in full.
    sampler = service.create_sampling_client(base_model="tiny").result()
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 1,
                         types.SamplingParams(max_tokens=5, seed=1)).result(WAIT_SECONDS)
    assert len(out.sequences[0].tokens) <= 5


def test_an_sdk_sample_future_cancelled_by_its_caller_leaves_the_pool(service, base_url):
    sampler = service.create_sampling_client(base_model="tiny").result()
    before = _decoded(base_url)
    future = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, ENDLESS)
    at_cancel = _wait_decoding(base_url, before)
    # The SDK answers a cancelled sample future with `cancel_future` (its cancel queue).
    assert future.future().cancel()
    stopped = _wait_still(base_url)
    assert stopped - before < MAX_TOKENS, (before, at_cancel, stopped)
    assert stopped - at_cancel < STOPPED_WITHIN_TOKENS + 100   # the SDK's own queue too
    assert _metric(base_url, "twinkle_decode_rows_active") == 0


def test_a_closed_session_ends_its_sample_in_the_pool_at_once(http, base_url):
    """A sample pending when its session closed once ran to its end (104 s later) for
    nobody. Now the close answers it, naming the session's end, and the pool drops its
    row at the next step."""
    session = http.post("/api/v1/create_session", json={}).json()["session_id"]
    sampler = http.post("/api/v1/create_sampling_session", json={
        "session_id": session, "base_model": "tiny"}).json()["sampling_session_id"]
    before = _decoded(base_url)
    request_id = http.post("/api/v1/asample", json={
        "sampling_session_id": sampler, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": ENDLESS.model_dump()}).json()["request_id"]
    _wait_decoding(base_url, before)
    assert http.post(f"/api/v1/sessions/{session}/finish", json={}).is_success
    closed = _decoded(base_url)
    failed = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
    assert f"{sampler!r} has ended (session closed)" in failed["error"], failed
    stopped = _wait_still(base_url)
    assert stopped - closed < STOPPED_WITHIN_TOKENS, (before, closed, stopped)
