"""Errors as the SDK's own exceptions with the server's messages, keys, and tenant
isolation of every HTTP route.

The isolation test enumerates the front's routes: a route added without a case here fails
the test until someone decides how it is isolated.
"""

from __future__ import annotations

import sqlite3
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as tpb

from twinkle_server.http import unserved
from twinkle_server.http.admin import AdminRoutes
from twinkle_server.http.anthropic import AnthropicRoutes
from twinkle_server.http.app import MAX_BODY_BYTES, Front
from twinkle_server.http.external import ExternalRoutes
from twinkle_server.http.oai import OpenAIRoutes
from twinkle_server.http.rest import Rest
from twinkle_server.http.sampling import SamplingRoutes
from twinkle_server.http.training import TrainingRoutes
from twinkle_server.store import hash_key

from .conftest import sft_data

pytestmark = pytest.mark.integration


def test_a_bad_datum_fails_its_forward_backward_naming_the_field(service):
    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                      loss_fn_inputs={"target_tokens": np.array([1, 2], np.int64),
                                      "weights": np.ones(2, np.float32)})
    with pytest.raises(tinker.RequestFailedError, match="input_ids has 3 tokens"):
        tc.forward_backward([bad], "cross_entropy").result()


def test_unknown_model_is_not_found(base_url, server):
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]}) as http:
        r = http.post("/api/v1/get_info", json={"model_id": "run-000000000000"})
    assert r.status_code == 404 and "no model 'run-000000000000'" in r.json()["detail"]


def test_wrong_key_is_authentication_error(base_url):
    with pytest.raises(tinker.AuthenticationError, match="missing or invalid API key"):
        client = tinker.ServiceClient(base_url=base_url, api_key="tml-not-a-key")
        client.create_lora_training_client(base_model="tiny", rank=4).result()


def test_failed_op_is_request_failed_error(service):
    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint") as info:
        tc.load_state("tinker://run-000000000000/weights/none").result()
    assert info.value.category == "user"


def test_keys_have_the_sdk_prefix_and_legacy_keys_work(server, base_url):
    assert all(key.startswith("tml-") for key in server.keys.values())
    legacy = "tw-legacy-key-made-before-the-prefix-changed"
    with sqlite3.connect(server.data_dir / "twinkle.db") as db:
        db.execute("INSERT INTO api_keys VALUES (?, ?, ?, ?, NULL)",
                   (hash_key(legacy), "legacy", "carol", time.time()))
    client = tinker.ServiceClient(base_url=base_url, api_key="tml-" + legacy)
    assert client.get_server_capabilities().supported_models[0].model_name == "tiny"
    client.close("success").result()


def test_the_bearer_scheme_is_read_in_any_case_and_an_empty_key_header_is_left_out(
        server, base_url):
    key = server.keys["alice"]
    for headers in ({"authorization": f"bearer {key}"}, {"authorization": f"BEARER {key}"},
                    {"authorization": f"Bearer {key}", "x-api-key": ""}):
        r = httpx.get(f"{base_url}/api/v1/sessions", headers=headers, timeout=30)
        assert r.status_code == 200, (headers, r.text)
    r = httpx.get(f"{base_url}/api/v1/sessions", headers={"x-api-key": ""}, timeout=30)
    assert r.status_code == 401, r.text


@pytest.mark.parametrize(("lora", "says"), [
    ({"seed": 2**70}, f"lora_config.seed: {2**70}; give an integer in [0, 2^63)"),
    ({"seed": -1}, "lora_config.seed: -1; give an integer in [0, 2^63)"),
    ({"train_mlp": "false"}, "lora_config.train_mlp: must be true or false, got 'false'"),
    ({"train_attn": 0}, "lora_config.train_attn: must be true or false, got 0"),
    ({"train_unembed": "yes"}, "lora_config.train_unembed: must be true or false, got 'yes'"),
])
def test_create_model_refuses_a_bad_lora_config_field_by_name_and_makes_no_run(
        server, base_url, service, lora, says):
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]},
                      timeout=30) as http:
        def runs() -> int:
            return http.get("/api/v1/training_runs").json()["cursor"]["total_count"]
        before = runs()
        r = http.post("/api/v1/create_model", json={
            "session_id": service.holder.get_session_id(), "base_model": "tiny",
            "lora_config": {"rank": 4, **lora}})
        assert r.status_code == 400, r.text
        assert r.json()["detail"] == says
        assert runs() == before


# ----------------------------------------------------------------------------- isolation


@pytest.fixture(scope="module")
def alice_objects(service, server, base_url):
    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    tc.forward_backward(sft_data(n=1), "cross_entropy").result()
    saved = tc.save_state("mine").result().path
    sampler_path = tc.save_weights_for_sampler("mine-s").result().path
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]}) as http:
        future = http.post("/api/v1/unload_model",
                           json={"model_id": "run-000000000000"}).json()
        future = http.post("/api/v1/create_model", json={
            "session_id": service.holder.get_session_id(), "model_seq_id": 99,
            "base_model": "tiny", "lora_config": {"rank": 4}}).json()["request_id"]
        upload = http.post("/api/v1/external_weights_upload_start", json={
            "base_model": "tiny", "lora_config": {"rank": 4}}).json()["upload_id"]
    return {"upload": upload, "model": tc.model_id, "run": saved.split("/")[2], "saved": saved,
            "sampler_path": sampler_path, "sampler": sampler._sampling_session_id,
            "session": service.holder.get_session_id(), "future": future}


def _forward_body(model_id: str) -> bytes:
    msg = tpb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([5, 6], np.int32).tobytes()
    return msg.SerializeToString()


PUBLIC = {("GET", "/api/v1/healthz"), ("GET", "/health"), ("POST", "/api/v1/client/config"),
          ("POST", "/api/v1/client/dynamic_config"), ("GET", "/api/v1/get_server_capabilities"),
          ("POST", "/api/v1/telemetry"), ("POST", "/api/v1/create_session"),
          ("POST", "/api/v1/external_weights_upload_start")}
"""Routes that name no tenant object (they answer the caller about the server or itself,
or create the caller's own session)."""
UNSERVED = {(method, "/api/v1" + path) for method, path, *_ in unserved.UNSERVED}
"""Routes that answer everyone that the server does not provide them (`test_rest_client`)."""
OPENAI_OTHERS = {(method, f"{prefix}/{{rest:path}}")
                 for method in ("GET", "POST", "PUT", "PATCH", "DELETE")
                 for prefix in ("/oai/api/v1", "/anthropic/api/v1")}
"""Any other route or method under the OpenAI or Anthropic prefix: 404 or 405 in their
shapes, naming no tenant object (`test_openai`, `test_anthropic`)."""
SIGNED = {("GET", "/api/v1/external_weights/{run_id}/{name}/{file}"),
          ("PUT", "/api/v1/external_weights_upload/{upload_id}/{file}"),
          ("GET", "/api/v1/session_traces/{session_id}.json"),
          ("GET", "/api/v1/operator/session_traces/{session_id}")}
"""Routes opened by a signed URL instead of a key (`test_external_weights`,
`test_session_traces`)."""
CHECKPOINT = "/api/v1/training_runs/{run_id}/checkpoints/{segment}/{name}"


def _cases(o: dict) -> dict[tuple[str, str], dict]:
    run, ckpt = o["run"], o["saved"].split("/", 3)[3]
    return {
        ("POST", "/api/v1/session_heartbeat"): {"json": {"session_id": o["session"]}},
        ("POST", "/api/v1/sessions/{session_id}/finish"):
            {"url": f"/api/v1/sessions/{o['session']}/finish", "json": {}},
        ("POST", "/api/v1/create_model"): {"json": {"session_id": o["session"],
                                                    "model_seq_id": 0, "base_model": "tiny",
                                                    "lora_config": {"rank": 4}}},
        ("POST", "/api/v1/get_info"): {"json": {"model_id": o["model"]}},
        ("POST", "/api/v1/unload_model"): {"json": {"model_id": o["model"]}},
        ("POST", "/api/v1/delete_model"): {"json": {"model_id": o["model"]}},
        ("POST", "/api/v1/forward_backward"): {"content": _forward_body(o["model"])},
        ("POST", "/api/v1/optim_step"): {"json": {"model_id": o["model"], "seq_id": 50}},
        ("POST", "/api/v1/save_weights"): {"json": {"model_id": o["model"], "path": "x"}},
        ("POST", "/api/v1/save_weights_for_sampler"):
            {"json": {"model_id": o["model"], "path": "x"}},
        ("POST", "/api/v1/load_weights"): {"json": {"model_id": o["model"], "path": o["saved"],
                                                    "optimizer": False}},
        ("POST", "/api/v1/save_weights_external"): {"json": {"model_id": o["model"],
                                                             "path": "x"}},
        ("GET", f"{CHECKPOINT}/external_weights_urls"):
            {"url": f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/external_weights_urls"},
        ("POST", "/api/v1/create_sampling_session"):
            {"json": {"session_id": "", "sampling_session_seq_id": 0,
                      "model_path": o["sampler_path"]}},
        ("GET", "/api/v1/samplers/{sampler_id}"): {"url": f"/api/v1/samplers/{o['sampler']}"},
        ("POST", "/api/v1/asample"): {"json": {
            "sampling_session_id": o["sampler"], "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}]},
            "sampling_params": {"max_tokens": 1}}},
        ("POST", "/api/v1/retrieve_future"): {"json": {"request_id": o["future"]}},
        ("POST", "/api/v1/retrieve_future/{request_id}"): {
            "url": f"/api/v1/retrieve_future/{o['future']}"},
        ("POST", "/api/v1/cancel_future"): {"json": {"request_id": o["future"]}},
        ("GET", "/api/v1/training_runs/{run_id}"): {"url": f"/api/v1/training_runs/{run}"},
        ("GET", "/api/v1/training_runs/{run_id}/checkpoints"):
            {"url": f"/api/v1/training_runs/{run}/checkpoints"},
        ("DELETE", CHECKPOINT): {"url": f"/api/v1/training_runs/{run}/checkpoints/{ckpt}"},
        ("POST", f"{CHECKPOINT}/publish"):
            {"url": f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish"},
        ("DELETE", f"{CHECKPOINT}/publish"):
            {"url": f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/publish"},
        ("PUT", f"{CHECKPOINT}/ttl"):
            {"url": f"/api/v1/training_runs/{run}/checkpoints/{ckpt}/ttl",
             "json": {"ttl_seconds": 3600}},
        ("POST", "/api/v1/weights_info"): {"json": {"tinker_path": o["saved"]}},
        ("GET", "/api/v1/sessions/{session_id}"): {"url": f"/api/v1/sessions/{o['session']}"},
        ("GET", "/api/v1/sessions/{session_id}/trace_export"):
            {"url": f"/api/v1/sessions/{o['session']}/trace_export"},
        ("GET", "/api/v1/training_runs"): {"listing": "training_runs"},
        ("GET", "/api/v1/checkpoints"): {"listing": "checkpoints"},
        ("GET", "/api/v1/sessions"): {"listing": "sessions"},
        ("GET", "/api/v1/audit"): {"listing": "audit"},
        ("POST", "/api/v1/external_weights_upload_finish"): {"json": {"upload_id": o["upload"]}},
        ("GET", "/oai/api/v1/models"): {"listing": "models"},
        ("GET", "/oai/api/v1/models/{model:path}"):
            {"url": f"/oai/api/v1/models/{o['sampler_path']}"},
        ("POST", "/oai/api/v1/completions"): {"json": {"model": o["sampler_path"],
                                                       "prompt": [5], "max_tokens": 1}},
        ("POST", "/oai/api/v1/chat/completions"): {"json": {
            "model": o["sampler_path"], "messages": [{"role": "user", "content": "x"}]}},
        ("POST", "/anthropic/api/v1/messages"): {"json": {
            "model": o["sampler_path"], "max_tokens": 1,
            "messages": [{"role": "user", "content": "x"}]}},
        ("POST", "/anthropic/api/v1/messages/count_tokens"): {"json": {
            "model": o["sampler_path"], "messages": [{"role": "user", "content": "x"}]}},
        ("POST", "/api/v1/copy_weights"): {"json": {"source_path": o["saved"],
                                                    "destination_project_id": "proj"}},
    }


def test_every_route_is_tenant_isolated(server, base_url, alice_objects):
    front = Front(None)
    routes = {(m, r.path) for r in (*front.routes(), *TrainingRoutes(front).routes(),
                                    *SamplingRoutes(front).routes(), *Rest(front).routes(),
                                    *AdminRoutes(front).routes(),
                                    *ExternalRoutes(front).routes(),
                                    *OpenAIRoutes(front).routes(),
                                    *AnthropicRoutes(front).routes(), *unserved.routes())
              for m in r.methods if m != "HEAD"}
    cases = _cases(alice_objects)
    assert routes == set(cases) | PUBLIC | UNSERVED | SIGNED | OPENAI_OTHERS, \
        "a route without a case"
    secret = {v for k, v in alice_objects.items() if k != "future"}
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["bob"]},
                      timeout=60) as http:
        for (method, path), case in cases.items():
            url = case.get("url", path)
            if "listing" in case:
                r = http.get(url)
                assert r.status_code == 200, (path, r.text)
                assert not any(s in r.text for s in secret), path
                continue
            r = http.request(method, url, json=case.get("json"), content=case.get("content"))
            if r.status_code == 200 and "request_id" in r.json():
                r = http.post("/api/v1/retrieve_future",
                              json={"request_id": r.json()["request_id"]})
                assert r.status_code == 200 and "error" in r.json(), (path, r.text)
                assert "no " in r.json()["error"], (path, r.text)
                continue
            assert r.status_code == 404, (path, r.status_code, r.text)
    # alice's objects are all still there
    rest = tinker.RestClient(base_url=base_url, api_key=server.keys["alice"])
    names = [c.tinker_path for c in rest.list_checkpoints(alice_objects["run"]).result()
             .checkpoints]
    assert alice_objects["saved"] in names


@pytest.mark.parametrize("path", ["/api/v1/asample", "/api/v1/forward_backward",
                                  "/oai/api/v1/chat/completions",
                                  "/anthropic/api/v1/messages"])
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_refused_naming_it_before_it_is_parsed(server, base_url,
                                                                        path, declared):
    """A body past `MAX_BODY_BYTES` is a 400 naming the limit, whether its length is
    declared (refused before a byte is read) or it comes in chunks (refused once it
    passes the limit): no route parses, tokenizes or holds more than the limit."""
    size = MAX_BODY_BYTES + 1
    body = b"x" * size
    content = body if declared else (body[i:i + (1 << 20)] for i in range(0, size, 1 << 20))
    r = httpx.post(base_url + path, content=content, timeout=60,
                   headers={"X-API-Key": server.keys["alice"],
                            "Authorization": f"Bearer {server.keys['alice']}"})
    assert r.status_code == 400, r.text
    assert f"over the {MAX_BODY_BYTES} bytes (64 MiB) a request may carry" in r.text, r.text
