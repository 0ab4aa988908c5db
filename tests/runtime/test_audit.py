"""Audit entries with no stock-SDK call to walk them (issue 31, 3), in-process: a
checkpoint deleted by its TTL, a download over gRPC (`Runs.checkpoint_files`), the models
and sampling sessions a stopping server takes with it, and a signed URL bound to the
tenant it was signed for (the HTTP walk is `tests/http/test_audit_events.py`)."""

from __future__ import annotations

import asyncio
import time

import pytest

from twinkle_server.config.flags import ServerConfig
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import LoraSpec
from twinkle_server.runtime import OpRef, Runtime, audit, checkpoint_ref
from twinkle_server.runtime.signed_urls import BadSignature, Signer
from twinkle_server.store import Store


def _entries(rt: Runtime, tenant: str = "alice") -> list:
    rt._writer.submit(lambda: None).result()   # the entries queued so far are written
    return rt.store.audit_entries(tenant, 0, time.time() + 1)


async def _model(rt: Runtime) -> str:
    info = await rt.training.create_model("alice", spec=LoraSpec(rank=4, alpha=8, seed=0))
    return info.entry.model_id


def test_a_checkpoint_deleted_by_its_ttl_and_a_grpc_download_are_recorded(runtime):
    async def scenario():
        model_id = await _model(runtime)
        row = await runtime.training.save("alice", OpRef(model_id, 0), "sampler", "ttl")
        path = checkpoint_ref(f"tinker://{model_id}/sampler_weights/ttl")
        runtime.runs.checkpoint_files("alice", path)
        await runtime.runs.set_checkpoint_ttl("alice", path, 3600)
        await runtime.lifetimes.expire_checkpoints(now=time.time() + 7200)
        return row

    row = asyncio.run(scenario())
    entries = _entries(runtime)
    tinker_path = f"tinker://{row.run_id}/sampler_weights/ttl"
    [read] = [e for e in entries if e.event == "checkpoint_read"]
    assert read.details["purpose"] == "download" and read.details["tinker_path"] == tinker_path
    [deleted] = [e for e in entries if e.event == "checkpoint_delete"]
    assert deleted.details == {"actor": "alice", "reason": "expired", "model_id": row.run_id,
                               "tinker_path": tinker_path, "checkpoint_type": "sampler",
                               "owner": "alice"}


def test_a_stopping_server_records_the_models_and_samplers_it_takes_with_it(runtime):
    async def scenario():
        model_id = await _model(runtime)
        sampler = await runtime.sampling.create_session("alice", base_model="tiny")
        return model_id, sampler

    model_id, sampler = asyncio.run(scenario())
    runtime.stop(60)
    runtime.close()
    entries = runtime.store.audit_entries("alice", 0, time.time() + 1)
    assert [(e.details["model_id"], e.details["reason"]) for e in entries
            if e.event == "model_unload"] == [(model_id, "server stopped")]
    assert [(e.details["sampling_session_id"], e.details["reason"]) for e in entries
            if e.event == "sampler_end"] == [(sampler, "server stopped")]


def test_a_signed_url_checks_only_for_the_tenant_it_was_signed_for():
    signer = Signer(b"k" * 32)
    now = time.time()
    signed = signer.sign("/f", 600, now, reader="alice")
    assert signed.url.endswith("&reader=alice")
    signer.check("/f", str(signed.expires), signed.signature, now, reader="alice")
    for reader in ("bob", None):
        with pytest.raises(BadSignature):
            signer.check("/f", str(signed.expires), signed.signature, now, reader=reader)
    # A URL signed before URLs named a tenant still checks without one.
    old = signer.sign("/f", 600, now)
    assert "reader" not in old.url
    signer.check("/f", str(old.expires), old.signature, now)


def test_a_tenant_reads_its_own_entries_however_far_behind_the_store_writer_is(runtime):
    """Entries are written off the request path; a read of the log waits for the ones
    queued before it (read your writes). Once the read went straight to the store, and
    the stock SDK's publish, then get_audit_log, sometimes missed the publish."""
    import threading

    held = threading.Event()
    runtime.write_later(held.wait)          # the writer is busy with an earlier write
    runtime.record("alice", "session_create", session_id="s-1")

    async def scenario():
        read = asyncio.ensure_future(runtime.audit.entries("alice", "sessions"))
        await asyncio.sleep(0.2)
        assert not read.done()              # behind the held write, as its entry is
        held.set()
        return await read

    try:
        entries = asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        held.set()
    assert [e.details["session_id"] for e in entries] == ["s-1"]


def test_a_stopping_server_closes_its_sessions_and_a_starting_one_those_left_open(
        engine, tmp_path):
    """A restart takes every model and sampler a session held, so no session stays open
    across it to count against --max-sessions-per-tenant: a stop closes them, and a start
    closes those a killed server (no stop) left open; each close is in the audit log."""
    rt = Runtime(ServerConfig(data_dir=tmp_path), engine, Store(tmp_path))
    rt.start()
    stopped = asyncio.run(rt.runs.create_session("alice", {}))
    rt.stop(60)
    rt.close()
    rt.store.close()
    store = Store(tmp_path)
    assert store.open_sessions("alice") == 0
    killed = store.create_session("alice", {})   # what a SIGKILLed server leaves open
    store.close()
    rt = Runtime(ServerConfig(data_dir=tmp_path), engine, Store(tmp_path))
    try:
        entries = _entries(rt)
        assert rt.store.open_sessions("alice") == 0
        assert [(e.details["session_id"], e.details["reason"]) for e in entries
                if e.event == "session_close"] == [(stopped, "server stopped"),
                                                   (killed, "server restarted")]
    finally:
        rt.close()
        rt.store.close()


def test_a_day_past_the_most_one_answer_carries_is_refused_naming_how_to_narrow_it(
        runtime, monkeypatch):
    """The SDK's AuditLogResponse carries no cursor nor flag: a cut answer would drop
    entries unseen, so a day of more entries than one answer carries is refused, naming
    the limit and how to ask for fewer (an event_type, or one event's name)."""
    monkeypatch.setattr(audit, "MAX_ENTRIES_PER_DAY", 3)
    for n in range(4):
        runtime.record("alice", "checkpoint_read", purpose="sample", n=n)
    runtime.record("alice", "checkpoint_delete", tinker_path="tinker://r/weights/w")

    async def read(event_type: str) -> list:
        return await runtime.audit.entries("alice", event_type)

    for event_type in ("all", "checkpoints", "checkpoint_read"):
        with pytest.raises(InvalidArgument, match="more than 3 entries.*event_type"):
            asyncio.run(read(event_type))
    [deleted] = asyncio.run(read("checkpoint_delete"))
    assert deleted.details["tinker_path"] == "tinker://r/weights/w"
    assert asyncio.run(read("models")) == []
    with pytest.raises(InvalidArgument, match="event_type: 'checkpoint'"):
        asyncio.run(read("checkpoint"))
