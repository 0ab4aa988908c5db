"""Cancelling futures against a real server: a queued op's seq_id is released so later ops
run, a running sample stops on the server, a sent training op cannot be taken back (cancel
is False, it stays applied), and sample futures are `concurrent.futures.Future`s; a
SamplingClient pickles into another process, as tinker's does."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import multiprocessing
import pickle
import re
import threading
import time
import urllib.request
from collections.abc import Callable

import pytest
from tinker import types

from tinker_compat import RestClient, SamplingClient, ServiceClient
from twinkle_client.connection import MAX_INFLIGHT_CALLS
from twinkle_server.process import ServerProcess, start_server

from .conftest import sft_data

pytestmark = pytest.mark.integration

PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])
WAIT_S = 120.0
"""Bound on every wait: a hang fails the test instead of stalling the suite."""
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache) -> ServerProcess:
    """This module's server, with the HTTP front for its decode-pool metrics."""
    proc = start_server(tmp_path_factory.mktemp("cancellation-server"), http=True)
    yield proc
    proc.stop()


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """The sum of `name`'s samples on the server's /metrics whose labels include `labels`."""
    with urllib.request.urlopen(f"http://{server.http_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.05)


def fill_call_pool(service_client) -> threading.Event:
    """Occupy every thread of the client's call pool until the returned event is set, so
    the calls submitted meanwhile wait, queued and unsent."""
    gate = threading.Event()
    for _ in range(MAX_INFLIGHT_CALLS):
        service_client._conn.submit(gate.wait, WAIT_S)
    return gate


def test_cancelling_a_queued_op_releases_its_seq_id_so_later_ops_of_the_model_run(
        service_client):
    training_client = service_client.create_lora_training_client("tiny", rank=4).result()
    data = sft_data(1, 4)
    gate = fill_call_pool(service_client)
    before = training_client.forward(data, "cross_entropy")
    victim = training_client.forward_backward(data, "cross_entropy")
    step = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
    assert victim.future().cancel()
    gate.set()
    assert step.result(timeout=WAIT_S).metrics["grad_norm"] == 0.0  # no gradient reached it
    assert before.result(timeout=WAIT_S).metrics["loss:sum"] > 0
    assert victim.future().cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        victim.result(timeout=WAIT_S)
    after = training_client.forward_backward(data, "cross_entropy").result(timeout=WAIT_S)
    assert after.metrics["loss:sum"] > 0


@pytest.mark.parametrize("save", [
    lambda tc: tc.save_weights_and_get_sampling_client(),
    lambda tc: tc.save_state("cancelled", ttl_seconds=3600),
], ids=["sampling-client-snapshot", "save-with-ttl"])
def test_cancelling_a_queued_save_releases_its_seq_id(service_client, save):
    """The saves that send their own op (a snapshot for a sampling client, a save with a
    TTL) release their seq_id too when cancelled before they are sent."""
    training_client = service_client.create_lora_training_client("tiny", rank=4).result()
    gate = fill_call_pool(service_client)
    victim = save(training_client)
    after = training_client.forward(sft_data(1, 4), "cross_entropy")
    assert victim.future().cancel()
    gate.set()
    assert after.result(timeout=WAIT_S).metrics["loss:sum"] > 0


def cancelled_samples(server: ServerProcess) -> float:
    return metric(server, "twinkle_ops_total", kind="sample", outcome="cancelled")


def decoding_sample(server: ServerProcess, sampling_client):
    """A long sample of 8 rows, once all 8 decode on the server."""
    future = sampling_client.sample(PROMPT, 8, types.SamplingParams(max_tokens=2000, stop=[]))
    wait_until(lambda: metric(server, "twinkle_decode_rows_active") == 8,
               "the sample's 8 rows decoding")
    return future


def test_cancelling_a_running_sample_stops_it_on_the_server(server, service_client):
    sampling_client = service_client.create_sampling_client(base_model="tiny").result()
    future = decoding_sample(server, sampling_client)
    cancelled = cancelled_samples(server)
    sampled = metric(server, "twinkle_tokens_sampled_total")
    assert future.future().cancel()
    assert future.future().cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(timeout=WAIT_S)
    wait_until(lambda: cancelled_samples(server) == cancelled + 1,
               "the server cancelling the sample")
    wait_until(lambda: metric(server, "twinkle_decode_rows_active") == 0,
               "the sample's rows leaving the decode pool")
    assert metric(server, "twinkle_tokens_sampled_total") == sampled
    again = sampling_client.sample(PROMPT, 1, GREEDY).result(timeout=WAIT_S)
    assert len(again.sequences[0].tokens) == 6


def test_an_await_that_times_out_cancels_the_sample_as_tinker_does(server, service_client):
    sampling_client = service_client.create_sampling_client(base_model="tiny").result()
    future = decoding_sample(server, sampling_client)
    cancelled = cancelled_samples(server)

    async def wait_briefly() -> None:
        with pytest.raises(TimeoutError):
            await future.result_async(timeout=0.1)

    asyncio.run(wait_briefly())
    assert future.future().cancelled()
    wait_until(lambda: cancelled_samples(server) == cancelled + 1,
               "the server cancelling the sample")


def test_a_sent_training_op_cannot_be_cancelled_it_stays_applied(service_client, caplog):
    training_client = service_client.create_lora_training_client("tiny", rank=4).result()
    training_client.forward_backward(sft_data(64, 64), "cross_entropy")  # keeps the next waiting
    save = training_client.save_state("maybe-cancelled")
    reported = save.future().cancel()
    training_client.save_state("after").result(timeout=WAIT_S)
    with RestClient(base_url=service_client._conn.base_url) as rest:
        names = {c.checkpoint_id for c in
                 rest.list_checkpoints(training_client.model_id).result().checkpoints}
    assert "weights/after" in names
    assert ("weights/maybe-cancelled" in names) == (not reported)
    assert save.future().cancelled() == reported
    applied = training_client.optim_step(types.AdamParams(learning_rate=1e-4))
    applied.result(timeout=WAIT_S)
    assert not applied.future().cancel()
    assert not [r for r in caplog.records if r.name == "concurrent.futures"]


def test_sample_futures_are_concurrent_futures_for_wait_and_as_completed(service_client):
    sampling_client = service_client.create_sampling_client(base_model="tiny").result()
    sample = sampling_client.sample(PROMPT, 1, GREEDY)
    logprobs = sampling_client.compute_logprobs(PROMPT)
    assert isinstance(sample, concurrent.futures.Future)
    done, pending = concurrent.futures.wait([sample, logprobs], timeout=WAIT_S)
    assert done == {sample, logprobs} and not pending
    finished = list(concurrent.futures.as_completed(
        [sampling_client.sample(PROMPT, 1, GREEDY)], timeout=WAIT_S))
    assert len(finished[0].result().sequences[0].tokens) == 6
    assert logprobs.result()[0] is None
    with pytest.warns(FutureWarning, match="compatibility wrapper"):
        assert sample.done()


def _sample_in_worker(sampling_client: SamplingClient) -> list[int]:
    return list(sampling_client.sample(PROMPT, 1, GREEDY).result(timeout=WAIT_S)
                .sequences[0].tokens)


def test_a_pickled_sampling_client_samples_the_same_in_another_process(service_client):
    sampling_client = service_client.create_sampling_client(base_model="tiny").result()
    want = _sample_in_worker(sampling_client)
    copy = pickle.loads(pickle.dumps(sampling_client))
    assert copy.sampling_session_id == sampling_client.sampling_session_id
    assert _sample_in_worker(copy) == want
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        assert pool.submit(_sample_in_worker, sampling_client).result(timeout=WAIT_S) == want


def _sample_from_handle(handle: str) -> list[int]:
    return _sample_in_worker(SamplingClient.from_sampler_handle(handle, api_key="tml-worker"))


def test_a_sampler_handle_carries_no_key_and_makes_clients_of_the_same_sampler(base_url):
    """The SDK's pickle-free way to hand a sampler to other processes: a string, without
    credentials; each `from_sampler_handle` is a new client of the same sampler, using
    the key it is given (else this process's)."""
    with ServiceClient(base_url=base_url, api_key="tml-handle-secret") as service:
        sampling_client = service.create_sampling_client(base_model="tiny").result()
        want = _sample_in_worker(sampling_client)
        handle = sampling_client.get_sampler_handle()
        assert isinstance(handle, str)
        assert b"tml-handle-secret" not in base64.urlsafe_b64decode(handle)
        copy = SamplingClient.from_sampler_handle(handle)
        assert copy.sampling_session_id == sampling_client.sampling_session_id
        assert _sample_in_worker(copy) == want
        with concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn")) as pool:
            assert pool.submit(_sample_from_handle, handle).result(timeout=WAIT_S) == want
    with pytest.raises(ValueError, match="handle: not a sampler handle"):
        SamplingClient.from_sampler_handle("not-a-handle")
