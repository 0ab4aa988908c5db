"""The training loop through the stock `tinker` SDK over HTTP: losses, optimizer,
checkpoints, pipelined futures, asyncio, and the same numbers as `tinker_compat` over gRPC."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tinker import types

from tinker_compat import ServiceClient as CompatServiceClient

from .conftest import rl_data, sft_data

pytestmark = pytest.mark.integration
ADAM = types.AdamParams(learning_rate=1e-3)


@pytest.fixture(scope="module")
def training(service):
    return service.create_lora_training_client(base_model="tiny", rank=8, seed=3).result()


def test_losses_optim_and_forward(training):
    before = training.forward(sft_data(), "cross_entropy").result()
    out = training.forward_backward(sft_data(), "cross_entropy").result()
    assert out.metrics["loss:sum"] == pytest.approx(before.metrics["loss:sum"], rel=1e-5)
    assert len(out.loss_fn_outputs) == 4
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (16,) and np.all(logprobs < 0)
    for loss in ("importance_sampling", "ppo"):
        result = training.forward_backward(rl_data(), loss).result()
        assert np.isfinite(result.metrics["loss:sum"])
    step = training.optim_step(ADAM).result()
    # No `step` or `learning_rate` to overwrite the cookbook's own; the gradient norm.
    assert set(step.metrics) == {"grad_norm"} and step.metrics["grad_norm"] > 0
    after = training.forward(sft_data(), "cross_entropy").result()
    assert after.metrics["loss:sum"] < before.metrics["loss:sum"]


def test_pipelined_futures(training):
    """Ten ops submitted before any is awaited still run in submission order."""
    futures = []
    for _ in range(5):
        futures.append(training.forward_backward(sft_data(), "cross_entropy"))
        futures.append(training.optim_step(ADAM))
    results = [f.result() for f in futures]
    losses = [r.metrics["loss:sum"] for r in results[::2]]
    assert losses == sorted(losses, reverse=True)   # each step lowers the loss


def test_await_in_asyncio(training):
    async def main():
        fwd = training.forward(sft_data(), "cross_entropy")
        return await fwd
    assert np.isfinite(asyncio.run(main()).metrics["loss:sum"])


def test_save_and_resume_with_optimizer(service, training):
    path = training.save_state("resume-me").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/resume-me")
    expected = training.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    got = resumed.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]
    assert got == pytest.approx(expected, rel=1e-6)
    # Same optimizer state: one more identical step lands both at the same loss.
    for client in (training, resumed):
        client.forward_backward(sft_data(), "cross_entropy").result()
        client.optim_step(ADAM).result()
    a = training.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]
    b = resumed.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]
    assert a == pytest.approx(b, rel=1e-5)
    training.load_state(path).result()
    again = training.forward(sft_data(), "cross_entropy").result().metrics["loss:sum"]
    assert again == pytest.approx(expected, rel=1e-6)


def test_same_numbers_as_tinker_compat(server, service):
    """The same seeds through HTTP (stock SDK) and gRPC (tinker_compat) on one server."""
    compat = CompatServiceClient(base_url=f"http://{server.address}",
                                 api_key=server.keys["alice"])
    try:
        results = []
        for client in (service, compat):
            tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=11).result()
            fb = tc.forward_backward(sft_data(seed=5), "cross_entropy").result()
            tc.optim_step(ADAM).result()
            fwd = tc.forward(sft_data(seed=6), "cross_entropy").result()
            results.append((fb, fwd))
    finally:
        compat.close()
    (fb_http, fwd_http), (fb_grpc, fwd_grpc) = results
    for a, b in ((fb_http, fb_grpc), (fwd_http, fwd_grpc)):
        assert a.metrics["loss:sum"] == pytest.approx(b.metrics["loss:sum"], rel=1e-6)
        for x, y in zip(a.loss_fn_outputs, b.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(x["logprobs"].to_numpy(), y["logprobs"].to_numpy(),
                                       rtol=1e-5, atol=1e-6)
