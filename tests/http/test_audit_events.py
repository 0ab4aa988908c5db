"""Every change to a tenant's state and every read of its stored weights is in its audit
log (issue 31, 3), walked through the stock SDK over HTTP (raw HTTP where the SDK has no
call: unloading a model): sessions, models (created, unloaded by hand and with their
session), sampling sessions (on a checkpoint, on a snapshot; ended with their session),
checkpoints (saved by each save including `save_weights_external`, TTL set, published,
deleted) and reads (load, sample, download through a signed URL, by the owner and by
another tenant of a published export: the reader's entry, not the owner's). Expiries are
walked in `test_snapshot_lifetime.py` (sessions) and `tests/runtime/test_audit.py`
(checkpoint TTLs, a server stopping, gRPC downloads)."""

from __future__ import annotations

import time
import warnings

import httpx
import pytest
import tinker
from tinker import types

from ..audit_days import entries_since_yesterday
from .conftest import sft_data

pytestmark = pytest.mark.integration
WAIT_S = 30


def _log(base_url: str, key: str, until=lambda entries: True) -> list[types.AuditLogEntry]:
    """The tenant's entries since yesterday (UTC), once `until(entries)` holds (entries are written just
    after their op answers)."""
    admin = tinker.AdminClient(base_url=base_url, api_key=key)
    deadline = time.monotonic() + WAIT_S
    while True:
        entries = entries_since_yesterday(admin)
        if until(entries) or time.monotonic() > deadline:
            return entries
        time.sleep(0.2)


def _about(entries, event: str, **details) -> list[types.AuditLogEntry]:
    return [e for e in entries if e.event == event
            and all(e.event_details.get(k) == v for k, v in details.items())]


def test_every_state_change_and_weight_read_is_in_the_audit_log(server, base_url, tmp_path):
    keys = server.keys
    own = tinker.ServiceClient(base_url=base_url, api_key=keys["alice"])
    rest = {t: tinker.RestClient(base_url=base_url, api_key=keys[t]) for t in ("alice", "bob")}
    session = own.holder.get_session_id()
    tc = own.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    tc.forward_backward(sft_data(n=1), "cross_entropy").result()
    state = tc.save_state("audit-state").result().path
    sampler_path = tc.save_weights_for_sampler("audit-s").result().path
    external = tc.save_weights_external("audit-x").result().path
    sampler = own.create_sampling_client(model_path=sampler_path).result()
    snapshot = tc.save_weights_and_get_sampling_client().result()
    loaded = own.create_training_client_from_state(state).result()
    with warnings.catch_warnings():   # deprecated in the SDK, still a read to record
        warnings.simplefilter("ignore", FutureWarning)
        loaded.load_state(state).result()
    with httpx.Client(base_url=base_url, headers={"X-API-Key": keys["alice"]}) as http:
        assert http.post("/api/v1/unload_model",
                         json={"model_id": loaded.model_id}).status_code == 200
    rest["alice"].set_checkpoint_ttl_from_tinker_path(state, 7200).result()
    rest["alice"].publish_checkpoint_from_tinker_path(external).result()
    with httpx.Client(timeout=60) as plain:   # signed URLs carry no API key
        for reader in ("alice", "bob"):
            urls = rest[reader].get_external_weights_urls(external).result().urls
            url = urls["adapter_config.json"]
            assert plain.get(url).status_code == 200
    rest["alice"].unpublish_checkpoint_from_tinker_path(external).result()
    rest["alice"].delete_checkpoint_from_tinker_path(sampler_path).result()
    own.close("success").result()

    model = tc.model_id
    # Every event asserted below, before any is asserted: a close writes its unloads and
    # ends one after another, after it answers (the poll once waited for one of them).
    wanted = [("session_create", {"session_id": session}),
              ("session_close", {"session_id": session}),
              ("model_create", {"model_id": model}),
              ("model_create", {"from_checkpoint": state}),
              ("model_unload", {"reason": "unloaded by its owner"}),
              ("model_unload", {"model_id": model}),
              ("sampler_create", {"sampling_session_id": sampler._sampling_session_id}),
              ("sampler_create", {"sampling_session_id": snapshot._sampling_session_id}),
              ("sampler_end", {"sampling_session_id": sampler._sampling_session_id}),
              ("sampler_end", {"sampling_session_id": snapshot._sampling_session_id}),
              ("checkpoint_read", {"purpose": "sample", "tinker_path": sampler_path}),
              ("checkpoint_read", {"purpose": "download", "tinker_path": external}),
              ("checkpoint_ttl_set", {"tinker_path": state}),
              ("checkpoint_publish", {"tinker_path": external}),
              ("checkpoint_unpublish", {"tinker_path": external}),
              ("checkpoint_delete", {"tinker_path": sampler_path})]
    wanted += [("checkpoint_save", {"tinker_path": p}) for p in (state, sampler_path, external)]
    entries = _log(base_url, keys["alice"], lambda e: all(
        _about(e, event, **details) for event, details in wanted) and len(_about(
            e, "checkpoint_read", purpose="load", tinker_path=state)) >= 2)
    assert _about(entries, "session_create", session_id=session)
    assert _about(entries, "session_close", session_id=session)
    assert _about(entries, "model_create", model_id=model)
    # The SDK names a model made from a checkpoint by an alias; the log by its run id.
    [from_state] = _about(entries, "model_create", from_checkpoint=state)
    loaded_run = from_state.event_details["model_id"]
    [by_hand] = _about(entries, "model_unload", model_id=loaded_run)
    assert by_hand.event_details["reason"] == "unloaded by its owner"
    [with_session] = _about(entries, "model_unload", model_id=model)
    assert with_session.event_details["reason"] == "session closed"
    for path in (state, sampler_path, external):
        assert len(_about(entries, "checkpoint_save", tinker_path=path)) == 1, path
    [export] = _about(entries, "checkpoint_save", tinker_path=external)
    assert export.event_details["checkpoint_type"] == "external"
    assert _about(entries, "sampler_create", sampling_session_id=sampler._sampling_session_id,
                  model_path=sampler_path)
    assert _about(entries, "sampler_create", session_id=session, snapshot_of=model,
                  sampling_session_id=snapshot._sampling_session_id)
    for sampling_id in (sampler._sampling_session_id, snapshot._sampling_session_id):
        [end] = _about(entries, "sampler_end", sampling_session_id=sampling_id)
        assert end.event_details["reason"] == "session closed"
    reads = {(e.purpose, e.tinker_path) for e in entries if e.event == "checkpoint_read"}
    assert {("sample", sampler_path), ("load", state), ("download", external)} <= reads
    assert len(_about(entries, "checkpoint_read", purpose="load", tinker_path=state)) == 2
    [download] = _about(entries, "checkpoint_read", purpose="download", tinker_path=external)
    assert download.event_details["file"] == "adapter_config.json"
    assert _about(entries, "checkpoint_ttl_set", tinker_path=state, ttl_seconds=7200)
    assert _about(entries, "checkpoint_publish", tinker_path=external)
    assert _about(entries, "checkpoint_unpublish", tinker_path=external)
    assert _about(entries, "checkpoint_delete", tinker_path=sampler_path)
    assert all(e.event_details["actor"] == "alice" for e in entries)
    # Bob's download of alice's published export is bob's read, naming alice as owner.
    theirs = _log(base_url, keys["bob"], lambda e: bool(_about(
        e, "checkpoint_read", purpose="download", tinker_path=external)))
    [read] = _about(theirs, "checkpoint_read", purpose="download", tinker_path=external)
    assert read.event_details["actor"] == "bob" and read.event_details["owner"] == "alice"


def test_a_signed_url_is_bound_to_the_tenant_it_was_signed_for(service, server, base_url):
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=6).result()
    external = tc.save_weights_external("audit-bound").result().path
    rest = tinker.RestClient(base_url=base_url, api_key=server.keys["alice"])
    url = rest.get_external_weights_urls(external).result().urls["adapter_config.json"]
    assert "reader=alice" in url
    with httpx.Client(timeout=60) as plain:
        # The same signature for another reader would put the read in another's log.
        assert plain.get(url.replace("reader=alice", "reader=bob")).status_code == 403
        assert plain.get(url.replace("&reader=alice", "")).status_code == 403
        assert plain.get(url).status_code == 200
