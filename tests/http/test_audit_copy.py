"""`RestClient.copy_weights` and `AdminClient.get_audit_log` through the stock SDK: a copy
is the caller's, shares the source's bytes, survives the source, answers a retry with the
same copy; the audit log records who did what, and a tenant sees only its own entries."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from twinkle_server.runtime.copies import MAX_IDEMPOTENCY_KEY_CHARS

from ..audit_days import audit_days, entries_since_yesterday
from .conftest import sft_data

pytestmark = pytest.mark.integration
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8, 9])


@pytest.fixture(scope="module")
def rest(server, base_url) -> dict[str, tinker.RestClient]:
    return {tenant: tinker.RestClient(base_url=base_url, api_key=server.keys[tenant])
            for tenant in ("alice", "bob")}


@pytest.fixture(scope="module")
def saved(service):
    """Alice's trained adapter: a training checkpoint and a sampler checkpoint."""
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
    tc.forward_backward(sft_data(n=2), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return {"model": tc.model_id, "state": tc.save_state("to-copy").result().path,
            "sampler": tc.save_weights_for_sampler("to-copy-s").result().path}


def _files(server, path: str) -> dict[str, Path]:
    run_id, segment, name = path.removeprefix("tinker://").split("/")
    [directory] = (Path(server.data_dir) / "checkpoints").glob(f"*/{run_id}/{segment}/{name}")
    return {p.name: p for p in directory.iterdir() if p.is_file()}


def test_a_copy_is_a_new_run_of_the_caller_sharing_the_bytes_and_outliving_the_source(
        service, server, rest, saved):
    source = saved["sampler"]
    before = service.create_sampling_client(model_path=source).result() \
        .compute_logprobs(PROMPT).result()
    copy = rest["alice"].copy_weights(source, "proj-archive").result()
    run_id = copy.split("/")[2]
    assert copy == f"tinker://{run_id}/sampler_weights/to-copy-s"
    assert run_id != source.split("/")[2]
    listed = [c.tinker_path for c in rest["alice"].list_checkpoints(run_id).result().checkpoints]
    assert listed == [copy]
    run = rest["alice"].get_training_run(run_id).result()
    assert run.model_owner == "alice" and run.lora_rank == 4
    # Hard links: the same inodes, no bytes duplicated.
    src, dst = _files(server, source), _files(server, copy)
    assert sorted(src) == sorted(dst)
    assert all(os.stat(src[n]).st_ino == os.stat(dst[n]).st_ino for n in src)
    rest["alice"].delete_checkpoint_from_tinker_path(source).result()
    after = service.create_sampling_client(model_path=copy).result() \
        .compute_logprobs(PROMPT).result()
    assert after == before   # the same weights: the same numbers, exactly


def test_a_training_checkpoint_copy_loads_into_a_new_model(service, rest, saved):
    copy = rest["alice"].copy_weights(saved["state"], "proj", ttl_seconds=7200).result()
    listed = [c for c in rest["alice"].list_checkpoints(copy.split("/")[2]).result()
              .checkpoints]
    assert listed[0].checkpoint_type == "training" and listed[0].expires_at is not None
    tc = service.create_training_client_from_state(copy).result()
    assert tc.get_info().lora_rank == 4
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds: 10 is out of range"):
        rest["alice"].copy_weights(saved["state"], "proj", ttl_seconds=10).result()


def test_a_copy_with_a_session_id_is_listed_under_that_session(
        service, server, base_url, rest, saved):
    session_id = service.holder.get_session_id()
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]}) as http:
        copy = http.post("/api/v1/copy_weights", json={
            "source_path": saved["state"], "session_id": session_id, "model_seq_id": 7})
        bob = http.post("/api/v1/copy_weights", json={
            "source_path": saved["state"], "session_id": session_id},
            headers={"X-API-Key": server.keys["bob"]})
    run_id = copy.json()["tinker_path"].split("/")[2]
    assert run_id in rest["alice"].get_session(session_id).result().training_run_ids
    assert bob.status_code == 404   # bob may not read it, nor own the session


def test_a_retry_with_the_same_idempotency_key_answers_the_same_copy(server, base_url, saved):
    headers = {"X-API-Key": server.keys["alice"], "X-Idempotency-Key": "retry-me-1"}
    body = {"source_path": saved["state"], "destination_project_id": "proj"}
    with httpx.Client(base_url=base_url, headers=headers) as http:
        first = http.post("/api/v1/copy_weights", json=body)
        again = http.post("/api/v1/copy_weights", json=body)
        other = http.post("/api/v1/copy_weights", json=body,
                          headers={"X-Idempotency-Key": "retry-me-2"})
    assert first.status_code == again.status_code == other.status_code == 200
    assert first.json() == again.json()
    assert other.json()["tinker_path"] != first.json()["tinker_path"]


def test_an_idempotency_key_is_refused_when_over_long_or_reused_for_another_source(
        server, base_url, saved):
    prefix = "K" * MAX_IDEMPOTENCY_KEY_CHARS
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]},
                      timeout=60) as http:
        def copy(source: str, key: str) -> httpx.Response:
            return http.post("/api/v1/copy_weights", json={"source_path": source},
                             headers={"X-Idempotency-Key": key})

        def copies() -> int:
            return http.get("/api/v1/checkpoints?limit=1").json()["cursor"]["total_count"]

        before = copies()
        long = copy(saved["state"], prefix + "-first")
        assert long.status_code == 400, long.text
        assert long.json()["detail"] == (
            f"X-Idempotency-Key: {MAX_IDEMPOTENCY_KEY_CHARS + 6} characters, over the "
            f"{MAX_IDEMPOTENCY_KEY_CHARS} a key may have (the SDK sends a 36-character UUID)")
        assert copies() == before
        first = copy(saved["state"], "one-key")
        assert first.status_code == 200, first.text
        # Another source (the first copy itself) under the same key is not a retry.
        another = first.json()["tinker_path"]
        other = copy(another, "one-key")
        assert other.status_code == 400, other.text
        assert other.json()["detail"] == (
            f"idempotency_key: 'one-key' was used for a copy of {saved['state']!r}; a copy "
            f"of {another!r} needs a key of its own")
        assert copies() == before + 1
        assert copy(saved["state"], "one-key").json() == first.json()


def test_another_tenant_copies_only_what_it_may_read(server, rest, saved):
    private = saved["state"]
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        rest["bob"].copy_weights(private, "proj").result()
    # With alice's key as the access token, bob reads as alice; the copy is bob's.
    copy = rest["bob"].copy_weights(private, "proj",
                                    weights_access_token=server.keys["alice"]).result()
    assert copy.split("/")[2] in [r.training_run_id for r in rest["bob"].list_training_runs(
        limit=100).result().training_runs]
    with pytest.raises(tinker.AuthenticationError, match="weights_access_token"):
        rest["bob"].copy_weights(private, "proj", weights_access_token="tml-nope").result()
    rest["alice"].publish_checkpoint_from_tinker_path(private).result()
    try:
        assert rest["bob"].copy_weights(private, "proj").result().endswith("/weights/to-copy")
    finally:
        rest["alice"].unpublish_checkpoint_from_tinker_path(private).result()


def test_the_audit_log_records_who_did_what_and_each_tenant_sees_only_its_own(
        service, server, base_url, rest, saved):
    copy = rest["alice"].copy_weights(saved["state"], "proj").result()
    admin = {t: tinker.AdminClient(base_url=base_url, api_key=server.keys[t])
             for t in ("alice", "bob")}
    entries = entries_since_yesterday(admin["alice"])
    events = [e.event for e in entries]
    assert {"session_create", "model_create", "checkpoint_save", "checkpoint_copy",
            "checkpoint_read"} <= set(events)
    assert [e.timestamp for e in entries] == sorted(e.timestamp for e in entries)
    assert all(e.event_details["actor"] == "alice" for e in entries)
    saves = [e for e in entries if e.event == "checkpoint_save"]
    assert saved["state"] in [e.tinker_path for e in saves]
    assert all(e.model_id == e.tinker_path.split("/")[2] for e in saves)
    [copied] = [e for e in entries if e.event == "checkpoint_copy" and e.tinker_path == copy]
    assert copied.event_details["source"] == saved["state"]
    reads = [e for e in entries if e.event == "checkpoint_read" and e.purpose == "copy"]
    assert saved["state"] in [e.tinker_path for e in reads]
    created = [e for e in entries if e.event == "model_create"]
    assert saved["model"] in [e.event_details["model_id"] for e in created]
    only = entries_since_yesterday(admin["alice"], event_type="checkpoints")
    assert only and all(e.event.startswith("checkpoint_") for e in only)
    before = audit_days()[0] - dt.timedelta(days=1)
    assert admin["alice"].get_audit_log(day=before).result().entries == []
    # Bob's log holds none of alice's actions: not her session, her copy. (What bob
    # himself read of hers, with her leave, is his entry: `test_another_tenant_...`.)
    bob_log = entries_since_yesterday(admin["bob"])
    text = "".join(e.model_dump_json() for e in bob_log)
    for secret in (service.holder.get_session_id(), copy, '"actor":"alice"'):
        assert secret not in text
    assert all(e.event_details["actor"] == "bob" for e in bob_log)
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]}) as http:
        bad = http.get("/api/v1/audit", params={"event_type": "everything"})
        late = http.get("/api/v1/audit", params={"day": "yesterday"})
    assert bad.status_code == 400 and "event_type: 'everything'" in bad.text
    assert late.status_code == 400 and "day: 'yesterday' is not a date" in late.text


# ----------------------------------------------------------------------------- over gRPC
# The same verbs through `tinker_compat` on the same keyed server's gRPC port.


def test_tinker_compat_copies_and_reads_the_audit_log_with_the_same_isolation(
        server, rest, saved):
    from tinker_compat import RestClient

    grpc = {t: RestClient(base_url=f"http://{server.address}", api_key=server.keys[t])
            for t in ("alice", "bob")}
    try:
        copy = grpc["alice"].copy_weights(saved["state"], "proj").result()
        assert copy.endswith("/weights/to-copy") and copy != saved["state"]
        # Listed for alice over HTTP too: one store, one runtime.
        assert copy in [c.tinker_path for c in rest["alice"].list_checkpoints(
            copy.split("/")[2]).result().checkpoints]
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            grpc["bob"].copy_weights(saved["state"], "proj").result()
        with pytest.raises(ValueError, match="destination_project_id"):
            grpc["alice"].copy_weights(saved["state"])
        entries = entries_since_yesterday(grpc["alice"], event_type="checkpoints")
        [copied] = [e for e in entries if e.event == "checkpoint_copy" and e.tinker_path == copy]
        assert copied.event_details["source"] == saved["state"]
        assert copied.model_id == copy.split("/")[2]
        bob_text = "".join(e.model_dump_json() for e in entries_since_yesterday(grpc["bob"]))
        assert copy not in bob_text and '"actor":"alice"' not in bob_text
        with pytest.raises(tinker.BadRequestError, match="event_type: 'everything'"):
            grpc["alice"].get_audit_log(event_type="everything").result()
    finally:
        for client in grpc.values():
            client.close()
