"""The rest of the SDK's RestClient over HTTP: publishing checkpoints to every tenant,
checkpoint expiry, the session listing, and the SDK's routes this server does not
provide."""

from __future__ import annotations

import sqlite3
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from twinkle_client import errors
from twinkle_server.runtime.runs import DEFAULT_PAGE, MAX_PAGE

from ..service.transport import ProtoConnection
from .conftest import sft_data

pytestmark = pytest.mark.integration
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])


@pytest.fixture(scope="module")
def rest(server, base_url) -> dict[str, tinker.RestClient]:
    return {tenant: tinker.RestClient(base_url=base_url, api_key=server.keys[tenant])
            for tenant in ("alice", "bob")}


def _listed(rest: tinker.RestClient, path: str) -> types.Checkpoint | None:
    run_id = path.split("/")[2]
    return next((c for c in rest.list_checkpoints(run_id).result().checkpoints
                 if c.tinker_path == path), None)


# ----------------------------------------------------------------------------- publishing


def test_a_published_checkpoint_is_readable_by_every_tenant_and_changeable_only_by_its_owner(
        service, bob, server, rest, tmp_path):
    tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    tc.forward_backward(sft_data(n=2), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("shared").result().path
    sampler_path = tc.save_weights_for_sampler("shared-s").result().path
    expected = tc.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]
    grpc_bob = ProtoConnection(server.address, server.keys["bob"], client_name="test")
    try:
        # Private: bob sees nothing, on either front.
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            rest["bob"].get_weights_info_by_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            bob.create_sampling_client(model_path=sampler_path).result()
        with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
            bob.create_training_client_from_state(path).result()
        with pytest.raises(errors.NotFoundError):
            grpc_bob.download_checkpoint(path, tmp_path / "private")

        rest["alice"].publish_checkpoint_from_tinker_path(path).result()
        rest["alice"].publish_checkpoint_from_tinker_path(sampler_path).result()
        assert _listed(rest["alice"], path).public and _listed(rest["alice"], sampler_path).public

        # Published: bob loads, samples, reads and downloads it.
        info = rest["bob"].get_weights_info_by_tinker_path(path).result()
        assert info.base_model == "tiny" and info.lora_rank == 4
        loaded = bob.create_training_client_from_state(path).result()
        got = loaded.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]
        assert got == pytest.approx(expected, rel=1e-6)
        mine = service.create_sampling_client(model_path=sampler_path).result()
        theirs = bob.create_sampling_client(model_path=sampler_path).result()
        np.testing.assert_allclose(theirs.compute_logprobs(PROMPT).result()[1:],
                                   mine.compute_logprobs(PROMPT).result()[1:], rtol=1e-6)
        downloaded = grpc_bob.download_checkpoint(path, tmp_path / "public")
        assert (downloaded / "adapter_model.safetensors").is_file()

        # Only alice changes it; to bob it is still not his.
        for attempt in (rest["bob"].delete_checkpoint_from_tinker_path,
                        rest["bob"].unpublish_checkpoint_from_tinker_path,
                        rest["bob"].publish_checkpoint_from_tinker_path,
                        lambda p: rest["bob"].set_checkpoint_ttl_from_tinker_path(p, 3600)):
            with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
                attempt(path).result()
        with pytest.raises(tinker.APIStatusError, match="already public") as refused:
            rest["alice"].publish_checkpoint_from_tinker_path(path).result()
        assert refused.value.status_code == 412
        assert path not in [c.tinker_path for c in
                            rest["bob"].list_user_checkpoints(limit=1000).result().checkpoints]

        # Unpublished: private again.
        rest["alice"].unpublish_checkpoint_from_tinker_path(path).result()
        rest["alice"].unpublish_checkpoint_from_tinker_path(sampler_path).result()
        assert not _listed(rest["alice"], path).public
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            rest["bob"].get_weights_info_by_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            bob.create_sampling_client(model_path=sampler_path).result()
        with pytest.raises(errors.NotFoundError):
            grpc_bob.download_checkpoint(path, tmp_path / "again")
    finally:
        grpc_bob.close()


# ----------------------------------------------------------------------------- expiry


def test_a_checkpoint_ttl_is_listed_range_checked_and_ends_in_deletion(service, server, rest):
    """Set on a checkpoint or with its save; the expiry sweep deletes it when it ends."""
    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    path = tc.save_state("brief").result().path
    run_id = path.split("/")[2]
    alice = rest["alice"]
    for ttl in (3599, 10 * 365 * 86400 + 1):
        with pytest.raises(tinker.BadRequestError,
                           match=r"ttl_seconds: .*3600 \(1 hour\) to 315360000 \(10 years\)"):
            alice.set_checkpoint_ttl_from_tinker_path(path, ttl).result()
    alice.set_checkpoint_ttl_from_tinker_path(path, 86400).result()
    assert _listed(alice, path).expires_at.timestamp() == pytest.approx(time.time() + 86400,
                                                                       abs=60)
    alice.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert _listed(alice, path).expires_at is None
    # A TTL given with the save itself, checked the same way.
    timed = tc.save_state("timed", ttl_seconds=7200).result().path
    assert _listed(alice, timed).expires_at.timestamp() == pytest.approx(time.time() + 7200,
                                                                        abs=60)
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds: 60 is out of range"):
        tc.save_state("too-brief", ttl_seconds=60).result()

    alice.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    # An hour is the shortest TTL the SDK allows: let the hour pass in the store.
    with sqlite3.connect(server.data_dir / "twinkle.db") as db:
        db.execute("UPDATE checkpoints SET expires_at = ? WHERE run_id = ? AND name = 'brief'",
                   (time.time() - 1, run_id))
    db.close()
    directory = server.data_dir / "checkpoints" / "alice" / run_id / "weights" / "brief"
    deadline = time.time() + 30
    while _listed(alice, path) is not None or directory.exists():
        assert time.time() < deadline, "the expiry sweep left the checkpoint"
        time.sleep(0.2)
    assert "expired checkpoint " + path in server.log()


# ----------------------------------------------------------------------------- sessions


def test_the_session_listing_includes_a_session_with_no_runs_even_once_closed(
        server, base_url, rest):
    client = tinker.ServiceClient(base_url=base_url, api_key=server.keys["alice"])
    session_id = client.holder.get_session_id()
    assert rest["alice"].list_sessions(limit=5).result().sessions[0] == session_id
    assert rest["alice"].get_session(session_id).result().training_run_ids == []
    client.close("success").result()
    assert session_id in rest["alice"].list_sessions(limit=1000).result().sessions
    assert rest["alice"].get_session(session_id).result().sampler_ids == []
    assert session_id not in rest["bob"].list_sessions(limit=1000).result().sessions


# ----------------------------------------------------------------------------- paging

LISTINGS = ["/api/v1/checkpoints", "/api/v1/training_runs", "/api/v1/sessions"]


@pytest.mark.parametrize("listing", LISTINGS)
@pytest.mark.parametrize(("query", "says"), [
    ("limit=1&offset=99999999999999999999999",
     "offset: 99999999999999999999999 is out of range; give an integer in [0, 2^63)"),
    ("limit=99999999999999999999999",
     "limit: 99999999999999999999999 is out of range; give an integer in [0, 2^63)"),
    ("offset=-5", "offset: -5 is out of range; give an integer in [0, 2^63)"),
    ("limit=abc", "limit: 'abc' is not an integer"),
])
def test_a_page_argument_out_of_range_is_refused_naming_it(server, base_url, listing,
                                                           query, says):
    r = httpx.get(f"{base_url}{listing}?{query}", timeout=30,
                  headers={"X-API-Key": server.keys["alice"]})
    assert r.status_code == 400, r.text
    assert r.json()["detail"] == says


@pytest.mark.parametrize("listing", ["/api/v1/checkpoints", "/api/v1/training_runs"])
def test_the_cursor_reports_the_limit_its_page_was_served_with(server, base_url, listing):
    """The SDK asks for the next page while `offset + limit < total_count`: a cursor that
    echoed an asked limit over the most a page holds would end its paging early."""
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]},
                      timeout=30) as http:
        assert http.get(f"{listing}?limit=5000").json()["cursor"]["limit"] == MAX_PAGE
        assert http.get(listing).json()["cursor"]["limit"] == DEFAULT_PAGE
        assert http.get(f"{listing}?limit=1").json()["cursor"]["limit"] == 1


# ----------------------------------------------------------------------------- unserved

UNSERVED_CALLS = {
    "assign_session_project": lambda rest, run: rest.assign_session_project("sess-x", "proj"),
    "search_sessions": lambda rest, run: rest.search_sessions(types.SessionSearchRequest()),
}


@pytest.mark.parametrize("feature", sorted(UNSERVED_CALLS))
@pytest.mark.filterwarnings("ignore:RestClient.search_sessions is experimental")
def test_an_unserved_route_raises_not_found_naming_the_feature_without_a_retry(
        feature, server, rest):
    before = server.log().count("unserved route")
    with pytest.raises(tinker.NotFoundError, match=f"{feature}.*not provided by this server"):
        UNSERVED_CALLS[feature](rest["alice"], "run-000000000000").result()
    assert server.log().count("unserved route") == before + 1
