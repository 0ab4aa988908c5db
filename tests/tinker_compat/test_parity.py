"""Parity with the tinker SDK 0.38: every public method of its ServiceClient,
TrainingClient and RestClient exists here with its parameters; what the gRPC server offers
works (checkpoint TTLs on save, copies, client-side custom losses, the deprecated async
variants), and what it does not is refused by name; a split batch names datums by their
place in the caller's batch."""

from __future__ import annotations

import asyncio
import inspect
import warnings
from datetime import datetime, timezone

import numpy as np
import pytest
import tinker
from tinker import types
from tinker.lib.public_interfaces.custom_loss import LossHandle

from tinker_compat import RestClient, SamplingClient, ServiceClient, TrainingClient
from twinkle_server.process import start_server

from ..audit_days import audit_days
from .conftest import sft_data

pytestmark = pytest.mark.integration

PAIRS = [(tinker.ServiceClient, ServiceClient), (tinker.TrainingClient, TrainingClient),
         (tinker.RestClient, RestClient), (tinker.SamplingClient, SamplingClient)]
NOT_COMPARED = {
    ("ServiceClient", "holder"): "the SDK's HTTP client holder: internals, no gRPC equivalent",
    ("TrainingClient", "__init__"): "built by ServiceClient from a connection, not a holder",
    ("RestClient", "__init__"): "its first, private argument is a connection, not a holder",
    ("SamplingClient", "__init__"): "built from a connection, not a holder",
    ("SamplingClient", "create"): "builds a client from the SDK's HTTP client holder",
    ("SamplingClient", "on_queue_state_change"): "the SDK's HTTP futures report queue "
                                                 "states to it; gRPC calls have none",
}


def signature_gaps(sdk: type, compat: type, names: list[str]) -> list[str]:
    """How `compat` differs from `sdk` on `names`: a missing name, a parameter of another
    name, kind or default, or sync against async. Compat may give a default where the SDK
    gives none (`close(status="success")`): every SDK call still works."""
    gaps = []
    for name in names:
        if not hasattr(compat, name):
            gaps.append(f"{name}: missing")
            continue
        ours, theirs = getattr(compat, name), getattr(sdk, name)
        if not callable(theirs) or isinstance(theirs, type):
            continue
        if inspect.iscoroutinefunction(inspect.unwrap(theirs)) != \
                inspect.iscoroutinefunction(inspect.unwrap(ours)):
            gaps.append(f"{name}: sync/async differs")
        want = list(inspect.signature(theirs).parameters.values())
        got = list(inspect.signature(ours).parameters.values())
        if [(p.name, p.kind) for p in want] != [(p.name, p.kind) for p in got] or any(
                w.default is not inspect.Parameter.empty and w.default != g.default
                for w, g in zip(want, got, strict=True)):
            gaps.append(f"{name}: sdk {inspect.signature(theirs)} != {inspect.signature(ours)}")
    return gaps


def public_names(sdk: type) -> list[str]:
    return sorted(n for n in dir(sdk) if not n.startswith("_")) + ["__init__"]


def test_every_public_method_of_the_sdk_clients_exists_with_the_sdks_parameters():
    gaps = []
    for sdk, compat in PAIRS:
        names = [n for n in public_names(sdk) if (sdk.__name__, n) not in NOT_COMPARED]
        gaps += [f"{sdk.__name__}.{gap}" for gap in signature_gaps(sdk, compat, names)]
    assert gaps == []


def test_forward_backward_custom_warns_of_loss_type_input_and_serves_only_logprobs(
        service_client):
    """As the SDK: the deprecated parameter warns, and only "logprobs" is served."""
    training_client = service_client.create_lora_training_client("tiny", rank=4).result()
    data = sft_data(n=1)

    def loss_fn(data, logprobs_list):
        loss = -sum(lp.sum() for lp in logprobs_list)
        return loss, {}

    with pytest.warns(DeprecationWarning, match="loss_type_input"):
        out = training_client.forward_backward_custom(data, loss_fn,
                                                      loss_type_input="logprobs").result()
    assert out.metrics["loss:sum"] > 0
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="'probs'"):
        training_client.forward_backward_custom(data, loss_fn, loss_type_input="probs")


# ----------------------------------------------------------------------------- TTLs


def expiries(base_url: str, run_id: str) -> dict[str, datetime | None]:
    with RestClient(base_url=base_url) as rest:
        return {c.checkpoint_id: c.expires_at
                for c in rest.list_checkpoints(run_id).result().checkpoints}


def test_save_state_and_sampler_weights_expire_ttl_seconds_after_the_save(service_client,
                                                                          base_url):
    tc = service_client.create_lora_training_client("tiny", rank=4).result()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tc.save_state("ttl-state", ttl_seconds=7200).result(timeout=60)
        tc.save_weights_for_sampler("ttl-sampler", ttl_seconds=3600).result(timeout=60)
        tc.save_state("kept").result(timeout=60)
    assert not [w for w in caught if "ttl" in str(w.message)]
    now = datetime.now(timezone.utc)
    expires = expiries(base_url, tc.model_id)
    assert (expires["weights/ttl-state"] - now).total_seconds() == pytest.approx(7200, abs=60)
    assert (expires["sampler_weights/ttl-sampler"] - now).total_seconds() == \
        pytest.approx(3600, abs=60)
    assert expires["weights/kept"] is None


def test_a_ttl_the_server_would_refuse_saves_nothing_and_names_the_range(service_client,
                                                                         base_url):
    tc = service_client.create_lora_training_client("tiny", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=r"^ttl_seconds: 60 is out of range; give "
                                                     r"3600 \(1 hour\)"):
        tc.save_state("short", ttl_seconds=60).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match=r"^ttl_seconds: \d+ is out of range"):
        tc.save_weights_for_sampler("long", ttl_seconds=11 * 365 * 24 * 3600).result(timeout=60)
    tc.save_state("after").result(timeout=60)     # no seq_id was left unsent
    assert list(expiries(base_url, tc.model_id)) == ["weights/after"]


# ----------------------------------------------------------------------------- split batches


@pytest.fixture(scope="module")
def small_batch_url(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("small-batch"), "--max-batch-tokens", "20")
    yield f"http://{proc.address}"
    proc.stop()


def test_an_error_in_a_later_op_of_a_split_batch_names_the_datum_by_its_place_in_the_batch(
        small_batch_url):
    data = sft_data(4, 8)    # 32 tokens: two ops of two datums each under the 20-token limit
    data[3] = types.Datum(model_input=data[3].model_input, loss_fn_inputs={
        "target_tokens": np.full(8, 99999), "weights": np.ones(8, np.float32)})
    with ServiceClient(base_url=small_batch_url) as sc:
        tc = sc.create_lora_training_client("tiny", rank=4).result()
        for future in (tc.forward(data, "cross_entropy"),
                       tc.forward_backward(data, "cross_entropy"),
                       tc.forward_backward_custom(data, lambda d, lps: (
                           -sum(lp.sum() for lp in lps), {}))):
            with pytest.raises(tinker.BadRequestError,
                               match=r"^datum\[3\]\.target_tokens: token id 99999"):
                future.result(timeout=120)


# ----------------------------------------------------------------------------- RestClient


def test_the_deprecated_async_checkpoint_calls_do_what_their_sync_calls_do(service_client,
                                                                         base_url):
    tc = service_client.create_lora_training_client("tiny", rank=4).result()
    path = tc.save_state("shared").result(timeout=60).path

    async def run(rest: RestClient) -> None:
        await rest.publish_checkpoint_from_tinker_path_async(path)
        [published] = (await rest.list_checkpoints(tc.model_id)).checkpoints
        assert published.public
        await rest.unpublish_checkpoint_from_tinker_path_async(path)
        await rest.set_checkpoint_ttl_from_tinker_path_async(path, 7200)
        [changed] = (await rest.list_checkpoints(tc.model_id)).checkpoints
        assert not changed.public and changed.expires_at is not None
        entries = [e for day in audit_days() for e in
                   (await rest.get_audit_log_async(event_type="checkpoints", day=day)).entries]
        events = [e.event for e in entries if e.tinker_path == path]
        assert events[-3:] == ["checkpoint_publish", "checkpoint_unpublish", "checkpoint_ttl_set"]

    with RestClient(base_url=base_url) as rest, pytest.warns(FutureWarning, match="DEPRECATED"):
        asyncio.run(run(rest))


UNSERVED = {
    "get_session": ("sess-x",), "list_sessions": (), "export_session_trace": ("sess-x",),
    "get_sampler": ("sampler-x",), "search_sessions": (types.SessionSearchRequest(),),
    "assign_session_project": ("sess-x", "proj"), "whoami": (),
    "get_billing_usage": ("2026-01-01", "2026-02-01"),
    "get_current_checkpoint_storage_usage": (),
}
OVER_HTTP = {"get_session", "list_sessions", "export_session_trace", "get_sampler"}
"""Served to the stock SDK by the server's HTTP front, but by no gRPC call."""


@pytest.mark.parametrize("method", sorted(UNSERVED))
def test_a_rest_call_the_grpc_server_lacks_raises_not_found_naming_it(base_url, method):
    args = UNSERVED[method]
    with RestClient(base_url=base_url) as rest:
        with pytest.raises(tinker.NotFoundError,
                           match=rf"^{method}: not served by this server; ") as caught:
            getattr(rest, method)(*args)
        assert ("gRPC front has no call for it; the stock tinker SDK gets it from the "
                "server's HTTP front" in str(caught.value)) == (method in OVER_HTTP)
        if hasattr(rest, f"{method}_async"):
            with pytest.warns(FutureWarning), pytest.raises(tinker.NotFoundError, match=method):
                asyncio.run(getattr(rest, f"{method}_async")(*args))


def test_console_urls_are_refused_by_name_and_telemetry_is_none(service_client, base_url):
    tc = service_client.create_lora_training_client("tiny", rank=4).result()
    for client in (service_client, tc):
        with pytest.raises(tinker.NotFoundError, match=r"^get_console_url: .* no web console"):
            client.get_console_url()
        assert client.get_telemetry() is None
    with RestClient(base_url=base_url) as rest:
        assert rest.get_telemetry() is None


# ----------------------------------------------------------------------------- parameters


def test_load_state_takes_weights_access_token_none_and_refuses_a_token_by_name(
        service_client):
    tc = service_client.create_lora_training_client("tiny", rank=4).result()
    path = tc.save_state("w").result(timeout=60).path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        assert tc.load_state(path, weights_access_token=None).result(timeout=60).path == path
        assert tc.load_state_with_optimizer(path, None).result(timeout=60).path == path
        for load in (tc.load_state, tc.load_state_with_optimizer):
            with pytest.raises(ValueError, match=r"^weights_access_token: .*copy_weights"):
                load(path, weights_access_token="tml-another-tenant")
    assert tc.forward(sft_data(1), "cross_entropy").result(timeout=60).metrics


def test_service_client_refuses_default_headers_by_name_and_takes_none(base_url):
    with pytest.raises(ValueError, match=r"^default_headers_overrides: .*gRPC"):
        ServiceClient(base_url=base_url, default_headers_overrides={"X-Trace": "1"})
    with ServiceClient(base_url=base_url, default_headers_overrides=None) as sc:
        assert sc.session_id


def test_service_client_copy_weights_copies_into_a_new_run_that_expires(base_url):
    with ServiceClient(base_url=base_url, project_id="archive") as sc:
        tc = sc.create_lora_training_client("tiny", rank=4).result()
        source = tc.save_state("to-copy").result(timeout=60).path
        copy = sc.copy_weights(source, ttl_seconds=7200).result(timeout=60)
    run_id = copy.removeprefix("tinker://").split("/")[0]
    assert run_id != tc.model_id and copy.endswith("/weights/to-copy")
    assert expiries(base_url, run_id)["weights/to-copy"] is not None


# ----------------------------------------------------------------------------- custom losses


def neg_ll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def test_a_loss_from_create_custom_loss_trains_exactly_as_the_same_callable(service_client):
    handle = service_client.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    assert isinstance(handle, LossHandle) and handle.name == "neg_ll" and handle.loss_id is None

    def same(data, logprobs_list):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum()
                   for d, lp in zip(data, logprobs_list, strict=True))
        return loss, {"custom/neg_ll:sum": loss.detach().item()}

    data = sft_data(3, 8)
    results = []
    for loss_fn in (handle, same):
        tc = service_client.create_lora_training_client("tiny", rank=4, seed=3).result()
        out = tc.forward_backward_custom(data, loss_fn).result(timeout=120)
        step = tc.optim_step(types.AdamParams(learning_rate=0.0)).result(timeout=60)
        results.append((out.metrics, step.metrics["grad_norm"]))
    (got, got_norm), (want, want_norm) = results
    assert got == pytest.approx(want, rel=1e-5) and got_norm == pytest.approx(want_norm, rel=1e-5)


def test_a_custom_loss_refuses_what_it_cannot_run_by_name(service_client):
    def branchy(logprobs):
        loss = logprobs.sum() if logprobs.sum() > 0 else -logprobs.sum()
        return loss, {}

    with pytest.raises(ValueError, match=r"create_custom_loss: branchy cannot be traced"):
        service_client.create_custom_loss(branchy, {"logprobs": 1})
    handle = service_client.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    tc = service_client.create_lora_training_client("tiny", rank=4).result()
    [datum] = sft_data(1)
    unweighted = types.Datum(model_input=datum.model_input,
                             loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"]})
    with pytest.raises(ValueError, match=r"datum\[0\] has no loss_fn_inputs\['weights'\]"):
        tc.forward_backward_custom([unweighted], handle).result(timeout=120)
