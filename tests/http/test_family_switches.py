"""Tinker's LoRA switches through the stock `tinker` SDK on a model with fused projections
(phi3: `qkv_proj`, `gate_up_proj`): `create_lora_training_client`'s switches reach
`LoraSpec.from_tinker` on the server and select by role (`engine.roles`)."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from ..engine.families import write_family
from .conftest import keyed_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def phi3(tmp_path_factory, tiny_cache):
    model = write_family(tmp_path_factory.mktemp("models"), "phi3", tiny_cache)
    proc = keyed_server(tmp_path_factory.mktemp("phi3-server"), "--model", str(model))
    client = tinker.ServiceClient(base_url=f"http://{proc.http_address}",
                                  api_key=proc.keys["alice"])
    yield client
    client.close("success").result()
    proc.stop()


def _data(length: int = 12) -> list[types.Datum]:
    ids = np.arange(3, 3 + length + 1) * 37 % 400 + 3
    return [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": ids[1:],
                                        "weights": np.ones(length, np.float32)})]


def test_the_sdks_switches_train_fused_layers_and_the_loss_falls(phi3):
    base = phi3.get_server_capabilities().supported_models[0].model_name
    training = phi3.create_lora_training_client(base_model=base, rank=8, seed=1)
    losses = []
    for _ in range(4):
        losses.append(training.forward_backward(_data(), "cross_entropy").result()
                      .metrics["loss:sum"])
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < 0.95 * losses[0], losses
    attention_only = phi3.create_lora_training_client(
        base_model=base, rank=4, seed=2, train_mlp=False, train_unembed=False)
    out = attention_only.forward_backward(_data(), "cross_entropy").result()
    assert np.isfinite(out.metrics["loss:sum"])
