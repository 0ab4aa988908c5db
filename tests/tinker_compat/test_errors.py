"""Failures through the shim: each becomes the right Tinker exception with the server's
message, fails its own future only, and leaves the model ready for the next op. Tenant
isolation runs on its own server with API keys."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import tinker
from tinker import types

from tinker_compat import RestClient, ServiceClient
from twinkle_server.process import start_server

from .conftest import sft_data

pytestmark = pytest.mark.integration


def datum(tokens: list[int], targets: list[int], weights: list[float]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": np.array(targets),
                                       "weights": np.array(weights, np.float32)})


@pytest.fixture
def training_client(service_client):
    return service_client.create_lora_training_client("tiny", rank=4, seed=0).result()


@pytest.mark.parametrize(("data", "loss_fn", "message"), [
    ([datum([1, 2, 99999], [2, 3, 4], [1, 1, 1])], "cross_entropy",
     r"datum\[0\].input_ids: token id 99999 is outside the vocabulary"),
    ([datum([1, 2, 3], [2, 3, 99999], [1, 1, 1])], "cross_entropy", r"target_tokens.*99999"),
    ([datum([1, 2, 3], [2, 3, 4], [1, 1])], "cross_entropy",
     r"datum\[0\].loss_inputs\['weights'\]: first dimension is 2 but input_ids has 3"),
    (sft_data(1), "no_such_loss", r"loss_fn: unknown loss 'no_such_loss'"),
    ([*sft_data(1), datum([1, -5, 3], [2, 3, 4], [1, 1, 1])], "cross_entropy",
     r"datum\[1\].input_ids: token ids must be non-negative, found -5"),
    ([*sft_data(2), datum([1, 2, 3], [2, 2**40, 4], [1, 1, 1])], "cross_entropy",
     r"datum\[2\].loss_inputs\['target_tokens'\]: token id 1099511627776 does not fit"),
])
def test_bad_requests_fail_their_future_with_bad_request_error_and_training_goes_on(
        training_client, data, loss_fn, message):
    failed = training_client.forward_backward(data, loss_fn)
    step = training_client.optim_step(types.AdamParams(learning_rate=1e-3))
    error = failed.exception(timeout=120)
    assert isinstance(error, tinker.BadRequestError) and isinstance(error, tinker.TinkerError)
    assert error.status_code == 400
    with pytest.raises(tinker.BadRequestError, match=message):
        failed.result()
    assert set(step.result().metrics) == {"grad_norm"}
    assert training_client.forward_backward(sft_data(1), "cross_entropy").result().metrics


def test_a_custom_loss_that_raises_fails_its_future_and_the_next_ops_still_run(
        training_client):
    def broken(data, logprobs):
        raise RuntimeError("my loss is broken")

    failed = training_client.forward_backward_custom(sft_data(1), broken)
    after = training_client.forward_backward(sft_data(1), "cross_entropy")
    with pytest.raises(RuntimeError, match="my loss is broken"):
        failed.result(timeout=120)
    assert after.result(timeout=120).metrics["loss:sum"] > 0


def test_malformed_paths_names_and_missing_checkpoints_are_refused_clearly(service_client,
                                                                           training_client):
    with pytest.raises(ValueError, match="path: 'weights/x' must start with"):
        service_client.create_training_client_from_state("weights/x")
    with pytest.raises(ValueError, match="name: '../up' is not a valid checkpoint name"):
        training_client.save_state("../up")
    missing = service_client.create_sampling_client(
        model_path=f"tinker://{training_client.model_id}/sampler_weights/none")
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        missing.result()


def _key(data_dir, tenant: str) -> str:
    out = subprocess.run([sys.executable, "-m", "twinkle_server.cli", "keys", "create",
                          "--tenant", tenant, "--data-dir", str(data_dir)],
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, tiny_cache):
    data_dir = tmp_path_factory.mktemp("keyed")
    keys = {tenant: _key(data_dir, tenant) for tenant in ("alice", "bob")}
    proc = start_server(data_dir)
    yield f"http://{proc.address}", keys
    proc.stop()


def test_another_tenants_checkpoints_and_runs_look_like_none_and_a_bad_key_is_refused(
        keyed_server, tmp_path):
    base_url, keys = keyed_server
    with pytest.raises(tinker.AuthenticationError):
        ServiceClient(base_url=base_url, api_key="tw-not-a-key")
    with ServiceClient(base_url=base_url, api_key=keys["alice"]) as alice:
        trainer = alice.create_lora_training_client("tiny", rank=4).result()
        saved = trainer.save_state("mine").result().path
        sampler = trainer.save_weights_for_sampler("mine-s").result().path
        with ServiceClient(base_url=base_url, api_key=keys["bob"]) as bob, \
                RestClient(base_url=base_url, api_key=keys["bob"]) as rest:
            attempts = [
                bob.create_training_client_from_state(saved),
                bob.create_training_client_from_state_with_optimizer(saved),
                bob.create_sampling_client(model_path=sampler),
                rest.get_training_run(trainer.model_id),
                rest.get_training_run_by_tinker_path(saved),
                rest.get_weights_info_by_tinker_path(saved),
                rest.list_checkpoints(trainer.model_id),
                rest.delete_checkpoint_from_tinker_path(saved),
                rest.download_checkpoint(saved, tmp_path / "stolen"),
            ]
            for attempt in attempts:
                error = attempt.exception(timeout=120)
                assert isinstance(error, tinker.NotFoundError), error
                assert isinstance(error, tinker.TinkerError) and "no " in str(error)
            assert rest.list_user_checkpoints().result().checkpoints == []
        with RestClient(base_url=base_url, api_key=keys["alice"]) as mine:
            assert mine.get_training_run_by_tinker_path(saved).result().training_run_id == \
                trainer.model_id


def test_a_published_checkpoint_is_readable_by_another_tenant_until_unpublished(
        keyed_server, tmp_path):
    base_url, keys = keyed_server
    with ServiceClient(base_url=base_url, api_key=keys["alice"]) as alice, \
            RestClient(base_url=base_url, api_key=keys["alice"]) as mine, \
            ServiceClient(base_url=base_url, api_key=keys["bob"]) as bob, \
            RestClient(base_url=base_url, api_key=keys["bob"]) as theirs:
        trainer = alice.create_lora_training_client("tiny", rank=4).result()
        sampler = trainer.save_weights_for_sampler("shared").result().path
        mine.publish_checkpoint_from_tinker_path(sampler).result()
        mine.set_checkpoint_ttl_from_tinker_path(sampler, 7200).result()
        listed = mine.list_checkpoints(trainer.model_id).result().checkpoints
        assert listed[0].public and listed[0].expires_at is not None
        client = bob.create_sampling_client(model_path=sampler).result()
        assert client.compute_logprobs(types.ModelInput.from_ints([5, 6, 7])).result()
        theirs.download_checkpoint(sampler, tmp_path / "shared").result()
        for attempt in (theirs.delete_checkpoint_from_tinker_path(sampler),
                        theirs.unpublish_checkpoint_from_tinker_path(sampler),
                        theirs.set_checkpoint_ttl_from_tinker_path(sampler, None)):
            assert isinstance(attempt.exception(timeout=60), tinker.NotFoundError)
        with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
            mine.set_checkpoint_ttl_from_tinker_path(sampler, 60).result()
        mine.unpublish_checkpoint_from_tinker_path(sampler).result()
        error = theirs.download_checkpoint(sampler, tmp_path / "again").exception(timeout=60)
        assert isinstance(error, tinker.NotFoundError)
