"""The HTTP front serves TLS with the gRPC front's `--tls-cert/--tls-key`: the stock SDK
trains over https with a self-signed certificate it is told to trust, and a plaintext
request gets no answer."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from twinkle_server.process import start_server

from ..service.harness import create_key
from ..service.test_security import _self_signed
from ..tinker_compat.conftest import sft_data

pytestmark = pytest.mark.integration


def test_the_sdk_trains_over_https_and_plaintext_is_refused(tmp_path, tiny_cache, monkeypatch):
    cert, key, pem = _self_signed(tmp_path)
    data_dir = tmp_path / "data"
    api_key = create_key(data_dir, "alice")
    proc = start_server(data_dir, "--tls-cert", str(cert), "--tls-key", str(key), http=True,
                        tls_ca=pem)
    # httpx (under the SDK) trusts the CA bundle SSL_CERT_FILE names.
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    try:
        service = tinker.ServiceClient(base_url=f"https://{proc.http_address}", api_key=api_key)
        training = service.create_lora_training_client(base_model="tiny", rank=4).result()
        out = training.forward_backward(sft_data(n=2), "cross_entropy").result()
        assert np.isfinite(out.metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://{proc.http_address}/api/v1/healthz", timeout=10)
    finally:
        proc.stop()
