"""External weights (issue 23, 3): `save_weights_external` exports the adapter in PEFT
format, listed, TTL'd and deleted like any checkpoint, optionally age-encrypted; its
files download through signed, expiring URLs of the HTTP front, with no API key; the
download loads with `peft.PeftModel.from_pretrained` and gives the server's logprobs.
Both fronts: the stock SDK over HTTP, `tinker_compat` over gRPC.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit, urlunsplit

import httpx
import numpy as np
import pyrage
import pytest
import tinker
from tinker import types

import tinker_compat

from .conftest import download, peft_logprobs, sft_data

pytestmark = pytest.mark.integration
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors"}
LOGPROB_ATOL = 1e-4
"""float32 on CPU both ways; the server's chunked, packed pass and PEFT's plain forward
add in different orders, so they agree to rounding, not bit for bit. 1e-4 is loose for
that and ten times below the gap the adapter itself makes (checked in the test)."""


@pytest.fixture(scope="module")
def trained(service):
    """A model whose LoRA B is no longer zero (one step at lr 1e-2), so its logprobs
    differ from the base model's."""
    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    tc.forward_backward(sft_data(n=2), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc


@pytest.fixture(scope="module")
def rest(server, base_url):
    return tinker.RestClient(base_url=base_url, api_key=server.keys["alice"])


def test_export_downloads_with_signed_urls_and_loads_in_peft_with_the_server_logits(
        trained, rest, tmp_path):
    path = trained.save_weights_external("final", ttl_seconds=7200).result().path
    run = trained.model_id
    assert path == f"tinker://{run}/external_weights/final"
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
    assert listed[path].checkpoint_type == "external"
    assert listed[path].expires_at is not None and listed[path].size_bytes > 0

    response = rest.get_external_weights_urls(path).result()
    assert set(response.urls) == PEFT_FILES
    adapter = download(response.urls, tmp_path / "adapter")

    data = sft_data(n=2, seed=7)
    served = trained.forward(data, "cross_entropy").result()
    theirs, base = peft_logprobs(trained.get_info().model_data.tokenizer_id, adapter, data)
    for out, ref, plain in zip(served.loss_fn_outputs, theirs, base, strict=True):
        ours = out["logprobs"].to_numpy()
        np.testing.assert_allclose(ours, ref, atol=LOGPROB_ATOL, rtol=0)
        # The adapter matters: without it the logprobs are far from the server's.
        assert np.abs(ours - plain).max() > 10 * LOGPROB_ATOL


def test_an_encrypted_export_holds_the_same_files_once_decrypted(trained, rest, tmp_path):
    identity = pyrage.x25519.Identity.generate()
    plain_path = trained.save_weights_external("plain").result().path
    sealed_path = trained.save_weights_external(
        "sealed", age_encryption_recipients=[str(identity.to_public())]).result().path
    plain = download(rest.get_external_weights_urls(plain_path).result().urls, tmp_path / "p")
    sealed_urls = rest.get_external_weights_urls(sealed_path).result().urls
    assert set(sealed_urls) == {f"{name}.age" for name in PEFT_FILES}
    sealed = download(sealed_urls, tmp_path / "s")
    for name in PEFT_FILES:
        encrypted = (sealed / f"{name}.age").read_bytes()
        assert encrypted.startswith(b"age-encryption.org/v1\n")
        assert pyrage.decrypt(encrypted, [identity]) == (plain / name).read_bytes()
    with pytest.raises(pyrage.DecryptError):
        pyrage.decrypt((sealed / "adapter_model.safetensors.age").read_bytes(),
                       [pyrage.x25519.Identity.generate()])


def _with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()} | changes
    return urlunsplit(parts._replace(query="&".join(f"{k}={v}" for k, v in query.items())))


def test_a_signed_url_opens_only_its_own_path_until_its_checkpoint_is_deleted(trained, rest):
    path = trained.save_weights_external("signed").result().path
    urls = rest.get_external_weights_urls(path).result().urls
    config, weights = urls["adapter_config.json"], urls["adapter_model.safetensors"]
    with httpx.Client(timeout=60) as plain:
        assert plain.get(config).status_code == 200
        # config's signature on the weights' path; a changed expiry; none at all
        swapped = urlsplit(weights)._replace(query=urlsplit(config).query).geturl()
        later = _with_query(config, expires=str(int(parse_qs(urlsplit(config).query)
                                                    ["expires"][0]) + 3600))
        bare = urlsplit(config)._replace(query="").geturl()
        for bad in (swapped, later, bare, _with_query(config, signature="0" * 64)):
            r = plain.get(bad)
            assert r.status_code == 403, (bad, r.status_code, r.text)
        # another file of the same checkpoint, or one outside it, under a valid signature
        other = config.replace("adapter_config.json", "training_state.pt")
        assert plain.get(other).status_code == 403
        rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
        assert plain.get(config).status_code == 200
        rest.delete_checkpoint_from_tinker_path(path).result()
        assert plain.get(config).status_code == 404
    assert path not in {c.tinker_path for c in rest.list_checkpoints(trained.model_id)
                        .result().checkpoints}


def test_urls_are_for_external_weights_of_the_caller_only(trained, rest, server, base_url):
    saved = trained.save_state("not-external").result().path
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]},
                      timeout=60) as http:
        r = http.get(f"/api/v1/training_runs/{trained.model_id}/checkpoints/"
                     f"{saved.split('/', 3)[3]}/external_weights_urls")
        assert r.status_code == 400 and "not external weights" in r.json()["detail"]
    path = trained.save_weights_external("mine").result().path
    bob = tinker.RestClient(base_url=base_url, api_key=server.keys["bob"])
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        bob.get_external_weights_urls(path).result()


def test_tinker_compat_exports_over_grpc_with_urls_of_the_http_front(server, trained,
                                                                      tmp_path):
    """The same export through `tinker_compat` (gRPC): the URLs point at the HTTP front
    on the host the client reached the gRPC server at."""
    service = tinker_compat.ServiceClient(base_url=f"http://{server.address}",
                                          api_key=server.keys["alice"])
    try:
        tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
        tc.forward_backward(sft_data(n=2), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
            tc.save_weights_external("bad", age_encryption_recipients=["nope"]).result()
        path = tc.save_weights_external("grpc", ttl_seconds=3600).result().path
        assert path == f"tinker://{tc.model_id}/external_weights/grpc"
        rest = tinker_compat.RestClient(base_url=f"http://{server.address}",
                                        api_key=server.keys["alice"])
        response = rest.get_external_weights_urls(path).result()
        assert set(response.urls) == PEFT_FILES
        port = server.http_address.rsplit(":", 1)[1]
        assert all(urlsplit(u).port == int(port) for u in response.urls.values())
        adapter = download(response.urls, tmp_path / "adapter")
        data = sft_data(n=1, seed=3)
        served = tc.forward(data, "cross_entropy").result()
        model_dir = trained.get_info().model_data.tokenizer_id   # the HTTP front names it
        theirs, _ = peft_logprobs(model_dir, adapter, data)
        np.testing.assert_allclose(served.loss_fn_outputs[0]["logprobs"].to_numpy(),
                                   theirs[0], atol=LOGPROB_ATOL, rtol=0)
        listed = {c.tinker_path: c.checkpoint_type
                  for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
        assert listed[path] == "external"
        rest.close()
    finally:
        service.close()
