"""A model's ops see the state its earlier ops left, even when they arrive pipelined
while the worker is busy with another model: checks that read an adapter's state run
inside the op, in seq order, not when the request arrives."""

from __future__ import annotations

import time

import numpy as np
import pytest
from peft import LoraConfig

from twinkle_client import init_twinkle_client
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_server.process import start_server

from ..client.conftest import toy_features

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("op-order"))
    with init_twinkle_client(base_url=f"http://{proc.address}") as connected:
        yield connected
    proc.stop()


def _bare_model(seed: int) -> MultiLoraTransformersModel:
    """A fresh model with no loss and no optimizer set yet."""
    model = MultiLoraTransformersModel("tiny")
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8,
                                                     target_modules="all-linear"), seed=seed)
    return model


def _keep_worker_busy(seed: int) -> list:
    """Two queued 16 x 512-token passes of another model: seconds of work for the one
    worker, so ops sent right after them wait behind them."""
    busy = _bare_model(seed)
    busy.set_loss("CrossEntropyLoss")
    heavy = toy_features(16, length=512, prompt=8, seed=seed, vocab=4000)
    blockers = [busy.forward_backward(inputs=heavy, blocking=False) for _ in range(2)]
    # The client sends calls on a thread pool, so a later call of another model can
    # overtake these streams; give them time to arrive (they take milliseconds).
    time.sleep(0.5)
    return blockers


def test_pipelined_set_loss_then_forward_backward_runs_with_that_loss_while_worker_is_busy(
        client):
    model = _bare_model(seed=2)
    blockers = _keep_worker_busy(seed=1)
    features = toy_features(4, length=12, prompt=4, seed=2)
    set_loss = model.set_loss("CrossEntropyLoss", blocking=False)
    out = model.forward_backward(inputs=features, blocking=False)
    assert not blockers[-1].done(), "the worker finished before the ops under test arrived"
    set_loss.result(timeout=120)
    result = out.result(timeout=120)
    for blocker in blockers:
        blocker.result(timeout=120)

    # CrossEntropyLoss is a token mean (metric `loss:mean`), not Tinker's `loss:sum`.
    assert "loss:mean" in result.metrics and "loss:sum" not in result.metrics
    # `labels` are already shifted: position t's logprob scores labels[t].
    masks = [f["labels"] != -100 for f in features]
    picked = np.concatenate([np.asarray(lp)[m] for lp, m in zip(result.logps, masks,
                                                                strict=True)])
    mean = -float(picked.sum()) / picked.size
    # The same float32 logprobs summed in another order: rel 1e-5 covers the rounding.
    assert result.loss == pytest.approx(mean, rel=1e-5)


def test_pipelined_save_then_load_of_that_name_finds_the_checkpoint_while_worker_is_busy(
        client):
    model = _bare_model(seed=4)
    model.set_optimizer("AdamW", lr=1e-3)
    blockers = _keep_worker_busy(seed=3)
    saved = model.save("pipelined", save_optimizer=True, blocking=False)
    loaded = model.load("pipelined", load_optimizer=True, blocking=False)
    assert not blockers[-1].done(), "the worker finished before the ops under test arrived"
    assert saved.result(timeout=120).endswith("/weights/pipelined")
    assert loaded.result(timeout=120) is None
    for blocker in blockers:
        blocker.result(timeout=120)
