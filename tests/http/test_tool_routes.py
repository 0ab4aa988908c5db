"""The routes and fields other Tinker tools call that the SDK does not, driven with raw
httpx beside the stock SDK: `/health`, `delete_model`, `retrieve_future/{id}`,
`X-API-Key`, `asample` by `base_model` or `model_path` without a session, and the
gradient norm in `optim_step`'s result. Each answers as its SDK route does, under the
same keys and isolation."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
from tinker import types
from tinker.proto import tinker_public_pb2

pytestmark = pytest.mark.integration

PROMPT = types.ModelInput.from_ints([5, 17, 29, 3, 88, 41])


def http(server, base_url, tenant: str = "alice") -> httpx.Client:
    return httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys[tenant]},
                        timeout=60)


def result(client: httpx.Client, request_id: str) -> httpx.Response:
    """The future `request_id` through the path form of retrieve_future, once ready."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        answer = client.post(f"/api/v1/retrieve_future/{request_id}")
        if answer.status_code != 200 or not (answer.headers["content-type"].startswith(
                "application/json") and answer.json().get("type") == "try_again"):
            return answer
    raise AssertionError(f"{request_id} never finished")


def test_health_answers_ok_without_a_key(base_url):
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}


def test_delete_model_unloads_as_unload_model_does_and_only_for_its_owner(server, base_url,
                                                                          service):
    training = service.create_lora_training_client(base_model="tiny", rank=4).result()
    model_id = training.model_id
    with http(server, base_url, "bob") as bob:
        assert bob.post("/api/v1/delete_model", json={"model_id": model_id}).status_code == 404
    with http(server, base_url) as alice:
        promise = alice.post("/api/v1/delete_model", json={"model_id": model_id}).json()
        assert result(alice, promise["request_id"]).json() == {"type": "unload_model",
                                                               "model_id": model_id}
        gone = alice.post("/api/v1/get_info", json={"model_id": model_id})
    assert gone.status_code == 404


def test_retrieve_future_by_path_is_the_callers_own_and_an_unknown_key_is_refused(
        server, base_url):
    with httpx.Client(base_url=base_url, headers={"X-API-Key": "tml-not-a-key"}) as stranger:
        assert stranger.post("/api/v1/retrieve_future/fut-0").status_code == 401
    with http(server, base_url) as alice:
        assert alice.post("/api/v1/retrieve_future/fut-0000").status_code == 404


@pytest.mark.parametrize("by", ["base_model", "model_path"])
def test_asample_without_a_session_samples_the_base_or_a_checkpoint(server, base_url,
                                                                   service, by):
    if by == "base_model":
        source = {"base_model": "tiny"}
    else:
        training = service.create_lora_training_client(base_model="tiny", rank=4).result()
        source = {"model_path": training.save_weights_for_sampler("for-tools").result().path}
    body = types.SampleRequest(prompt=PROMPT, num_samples=2, sampling_params=types.SamplingParams(
        max_tokens=5, seed=3, temperature=1.0, stop=[]), **source)
    with http(server, base_url) as alice:
        promise = alice.post("/api/v1/asample", json=body.model_dump(mode="json"))
        assert promise.status_code == 200, promise.text
        answer = result(alice, promise.json()["request_id"])
    sampled = tinker_public_pb2.SampleResponse.FromString(answer.content)
    assert [np.frombuffer(seq.tokens, np.int32).size for seq in sampled.sequences] == [5, 5]


def test_asample_naming_nothing_to_sample_is_refused_naming_the_fields(server, base_url):
    body = types.SampleRequest(prompt=PROMPT, num_samples=1,
                               sampling_params=types.SamplingParams(max_tokens=2))
    with http(server, base_url) as alice:
        answer = alice.post("/api/v1/asample", json=body.model_dump(mode="json"))
    assert answer.status_code == 400
    assert "model_path or base_model" in answer.json()["detail"]
