"""What one tenant may have waiting is bounded (`--max-queued-ops-per-tenant`, here 4):
past it an op is refused at once, HTTP 429 naming the flag, and takes nothing, so the
stock SDK's retry of a 429 sends it again and it runs in order. The op its model runs
next is always taken, and another tenant's ops are not held by the flood."""

from __future__ import annotations

import re
import time

import httpx
import pytest
import tinker

from .conftest import keyed_server, sft_data
from .test_seq_ids import _forward_body, resolve

pytestmark = pytest.mark.integration

BOUND = 4


@pytest.fixture(scope="module")
def bounded(tmp_path_factory, tiny_cache):
    proc = keyed_server(tmp_path_factory.mktemp("bounded"),
                        "--max-queued-ops-per-tenant", str(BOUND))
    yield proc
    proc.stop()


def _client(server, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=f"http://{server.http_address}",
                        headers={"X-API-Key": server.keys[tenant]}, timeout=60)


def test_past_the_bound_an_op_is_a_429_naming_the_flag_and_its_seq_id_stays_free(bounded):
    """Alice's ops 2..5 wait for op 1 (a seq_id gap): four, her bound. Op 6 is refused
    with 429 and takes nothing; bob's op runs meanwhile; op 1 fills the gap even at the
    bound; then op 6, sent again, runs."""
    service = tinker.ServiceClient(base_url=f"http://{bounded.http_address}",
                                   api_key=bounded.keys["alice"])
    bob_service = tinker.ServiceClient(base_url=f"http://{bounded.http_address}",
                                       api_key=bounded.keys["bob"])
    model = service.create_lora_training_client(base_model="tiny", rank=4).result().model_id
    bob = bob_service.create_lora_training_client(base_model="tiny", rank=4).result()
    with _client(bounded, "alice") as alice:
        waiting = [alice.post("/api/v1/forward_backward", content=_forward_body(model, seq))
                   for seq in range(2, 2 + BOUND)]
        assert [w.status_code for w in waiting] == [200] * BOUND
        refused = alice.post("/api/v1/forward_backward", content=_forward_body(model, 6))
        assert refused.status_code == 429, refused.text
        assert re.search(r"--max-queued-ops-per-tenant: this tenant has 4 ops waiting",
                         refused.text), refused.text
        assert bob.forward(sft_data(n=2), "cross_entropy").result().loss_fn_outputs
        gap = alice.post("/api/v1/forward_backward", content=_forward_body(model, 1))
        for answer in (gap, *waiting):
            out = resolve(alice, answer)
            assert "error" not in out, out
        again = alice.post("/api/v1/forward_backward", content=_forward_body(model, 6))
        out = resolve(alice, again)
        assert "error" not in out, out
    service.close("success").result()
    bob_service.close("success").result()


def test_a_pipelining_sdk_client_past_the_bound_gets_every_result_through_its_retries(
        bounded):
    """24 forward_backward pipelined by the stock SDK while bob's long forward holds the
    worker, 4 at most waiting: the rest are answered 429 (counted in /metrics as
    `resource_exhausted`), the SDK sends them again, and every one returns, in order:
    with no optim_step between, each sees the same weights, so all 24 losses are equal
    (the same datums through the same pass: to float32 rounding of one pass, 1e-6)."""
    url = f"http://{bounded.http_address}"
    service = tinker.ServiceClient(base_url=url, api_key=bounded.keys["alice"])
    bob_service = tinker.ServiceClient(base_url=url, api_key=bounded.keys["bob"])
    training = service.create_lora_training_client(base_model="tiny", rank=4).result()
    bob = bob_service.create_lora_training_client(base_model="tiny", rank=4).result()
    long = bob.forward(sft_data(n=8, length=1000, seed=5), "cross_entropy")
    data = sft_data(n=2)
    futures = [training.forward_backward(data, "cross_entropy") for _ in range(24)]
    losses = [f.result().metrics["loss:sum"] for f in futures]
    assert long.result().loss_fn_outputs
    assert losses == pytest.approx([losses[0]] * 24, abs=1e-6)
    counted = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith("twinkle_ops_total{") and 'kind="forward_backward"' in line
               and 'outcome="resource_exhausted"' in line]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) > 0, counted
    service.close("success").result()
    bob_service.close("success").result()


@pytest.mark.parametrize("route, body", [
    ("/oai/api/v1/completions", {"model": "tiny", "prompt": "stream me", "max_tokens": 8,
                                 "stream": True}),
    ("/anthropic/api/v1/messages", {"model": "tiny", "max_tokens": 8, "stream": True,
                                    "messages": [{"role": "user", "content": "stream me"}]}),
], ids=["openai", "anthropic"])
def test_a_stream_past_the_bound_is_a_429_before_any_event(bounded, route, body):
    """With BOUND of alice's samples decoding, her stream request is refused as her other
    requests are: HTTP 429 naming the flag, not a 200 whose stream then carries the error
    (a client backs off and retries a 429). Bob streams meanwhile; once hers are
    cancelled, so does she."""
    endless = {"base_model": "tiny", "num_samples": 1,
               "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
               "sampling_params": {"max_tokens": 4000, "stop": [], "temperature": 1.0}}
    with _client(bounded, "alice") as alice, _client(bounded, "bob") as bob:
        decoding = [alice.post("/api/v1/asample", json=endless) for _ in range(BOUND)]
        assert [d.status_code for d in decoding] == [200] * BOUND
        refused = alice.post(route, json=body)
        assert refused.status_code == 429, refused.text
        assert "--max-queued-ops-per-tenant" in refused.text, refused.text
        theirs = bob.post(route, json=body)
        assert theirs.status_code == 200, theirs.text
        for answer in decoding:
            alice.post("/api/v1/cancel_future",
                       json={"request_id": answer.json()["request_id"]})
        deadline = time.monotonic() + 60
        while (again := alice.post(route, json=body)).status_code == 429:
            assert time.monotonic() < deadline, "the cancelled samples never left the queue"
            time.sleep(0.2)
        assert again.status_code == 200, again.text
