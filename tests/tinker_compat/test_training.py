"""Tinker-style training through the shim against a real server: the sync and the
async double-await loops of Tinker's docs, exact resume, pipelining, a running event
loop, and a batch over 16 MiB."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types
from transformers import AutoTokenizer

from tinker_compat import RestClient, ServiceClient, TrainingClient

from ..numerics import LOSS_RTOL
from .conftest import sft_data

pytestmark = pytest.mark.integration

ADAM = types.AdamParams(learning_rate=1e-2)


def adapter_weights(client: TrainingClient, base_url: str, name: str, dest
                    ) -> dict[str, np.ndarray]:
    path = client.save_weights_for_sampler(name).result().path
    with RestClient(base_url=base_url) as rest:
        folder = rest.download_checkpoint(path, dest / name).result()
    return load_file(str(folder / "adapter_model.safetensors"))


def assert_same_weights(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want) and got
    assert max(float(np.abs(got[k] - want[k]).max()) for k in got) <= 1e-6


def test_sync_result_loop_lowers_loss_and_returns_logprobs_per_datum_and_optim_metrics(
        service_client):
    data = sft_data(4, length=16) + sft_data(2, length=9, seed=1)
    training_client = service_client.create_lora_training_client(
        base_model="tiny", rank=8, seed=0).result()
    assert isinstance(training_client, TrainingClient)
    losses = []
    for _ in range(6):
        fwdbwd_future = training_client.forward_backward(data, "cross_entropy")
        optim_future = training_client.optim_step(ADAM)
        fwdbwd_result = fwdbwd_future.result()
        optim_result = optim_future.result()
        losses.append(fwdbwd_result.metrics["loss:sum"])
        assert [out["logprobs"].shape for out in fwdbwd_result.loss_fn_outputs] == \
            [[d.model_input.length] for d in data]
        assert isinstance(optim_result, types.OptimStepResponse)
        # No `step` or `learning_rate` to overwrite the cookbook's own; the gradient norm.
        assert set(optim_result.metrics) == {"grad_norm"}
    assert losses[-1] < 0.8 * losses[0], losses
    info = training_client.get_info()
    assert (info.model_id, info.lora_rank, info.model_data.model_name) == \
        (training_client.model_id, 8, "tiny")
    # What AutoTokenizer loads, as the HTTP front names it (the built-in model's files);
    # once the name "tiny", which nothing can load.
    tokenizer = AutoTokenizer.from_pretrained(info.model_data.tokenizer_id)
    assert tokenizer.encode("Hello") == training_client.get_tokenizer().encode("Hello")


def test_async_double_await_loop_of_tinker_docs_trains(base_url):
    data = sft_data(4)

    async def train() -> list[float]:
        with ServiceClient(base_url=base_url) as service_client:
            training_client = await service_client.create_lora_training_client(
                base_model="tiny", rank=8, seed=0)
            losses = []
            for _ in range(5):
                fwdbwd_future = await training_client.forward_backward_async(
                    data, "cross_entropy")
                optim_future = await training_client.optim_step_async(ADAM)
                losses.append((await fwdbwd_future).metrics["loss:sum"])
                assert set((await optim_future.result_async()).metrics) == {"grad_norm"}
            return losses

    with pytest.warns(FutureWarning, match="forward_backward_async"):
        losses = asyncio.run(train())
    assert losses[-1] < 0.8 * losses[0], losses


def test_save_state_then_create_from_state_with_optimizer_resumes_to_identical_weights(
        service_client, base_url, tmp_path):
    data = sft_data(4)
    straight = service_client.create_lora_training_client("tiny", rank=4, seed=3).result()
    for _ in range(2):
        straight.forward_backward(data, "cross_entropy")
        straight.optim_step(ADAM)
    saved = straight.save_state("half").result()
    assert saved.path == f"tinker://{straight.model_id}/weights/half"
    for _ in range(2):
        straight.forward_backward(data, "cross_entropy")
        straight.optim_step(ADAM)
    expected = adapter_weights(straight, base_url, "straight-end", tmp_path)

    twinkle_path = saved.path.replace("tinker://", "twinkle://")
    resumed = service_client.create_training_client_from_state_with_optimizer(
        twinkle_path).result()
    assert resumed.model_id != straight.model_id
    for _ in range(2):
        resumed.forward_backward(data, "cross_entropy")
        resumed.optim_step(ADAM)
    assert_same_weights(adapter_weights(resumed, base_url, "resumed-end", tmp_path), expected)

    fresh_optimizer = service_client.create_training_client_from_state(saved.path).result()
    for _ in range(2):
        fresh_optimizer.forward_backward(data, "cross_entropy")
        fresh_optimizer.optim_step(ADAM)
    other = adapter_weights(fresh_optimizer, base_url, "fresh-end", tmp_path)
    assert max(float(np.abs(other[k] - expected[k]).max()) for k in other) > 1e-4


def test_twenty_pairs_submitted_before_any_wait_equal_the_waited_version(
        service_client, base_url, tmp_path):
    data = sft_data(2, length=12)
    timings = {}
    weights = {}
    for mode in ("waited", "pipelined"):
        client = service_client.create_lora_training_client("tiny", rank=4, seed=5).result()
        start = time.perf_counter()
        futures = []
        for _ in range(20):
            pair = (client.forward_backward(data, "cross_entropy"), client.optim_step(ADAM))
            if mode == "waited":
                [future.result() for future in pair]
            futures.extend(pair)
        results = [future.result() for future in futures]
        assert [set(r.metrics) for r in results[1::2]] == [{"grad_norm"}] * 20   # optim_step
        timings[mode] = time.perf_counter() - start
        weights[mode] = adapter_weights(client, base_url, mode, tmp_path)
    print(f"20 x (forward_backward + optim_step): waited {timings['waited']:.2f} s, "
          f"pipelined {timings['pipelined']:.2f} s")
    assert_same_weights(weights["pipelined"], weights["waited"])


def test_inside_a_running_event_loop_awaiting_and_result_both_work(base_url):
    data = sft_data(2)

    async def cell() -> None:
        service_client = ServiceClient(base_url=base_url)
        training_client = await service_client.create_lora_training_client("tiny", rank=4)
        first = await training_client.forward_backward(data, "cross_entropy")
        step = training_client.optim_step(ADAM).result()  # blocking call on the loop thread
        second = training_client.forward_backward(data, "cross_entropy")
        assert isinstance(second, tinker.APIFuture)
        done = await asyncio.wait_for(second.result_async(), timeout=120)
        assert set(step.metrics) == {"grad_norm"}
        assert done.metrics["loss:sum"] < first.metrics["loss:sum"]
        sampling_client = await training_client.save_weights_and_get_sampling_client()
        both = await asyncio.gather(*(sampling_client.sample(
            types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3, seed=s)
        ) for s in range(2)))
        assert [len(r.sequences) for r in both] == [1, 1]
        service_client.close()

    asyncio.run(cell())


def test_a_batch_over_16_mib_is_streamed_through_with_outputs_in_datum_order(
        service_client):
    # 2-D targets [T, 256] make each token ~3 KiB on the wire, so 16 MiB stays a cheap pass.
    rng = np.random.default_rng(0)
    length, width = 64, 256
    data = [types.Datum(
        model_input=types.ModelInput.from_ints(rng.integers(3, 4000, length - i % 3).tolist()),
        loss_fn_inputs={"target_tokens": rng.integers(3, 4000, (length - i % 3, width)),
                        "weights": np.full((length - i % 3, width), 1 / width, np.float32)})
        for i in range(90)]
    wire_bytes = sum(d.model_input.length * (4 + 12 * width) for d in data)
    assert wire_bytes > 16 * 2**20
    training_client = service_client.create_lora_training_client("tiny", rank=4).result()
    result = training_client.forward(data, "cross_entropy").result(timeout=300)
    assert [out["logprobs"].shape for out in result.loss_fn_outputs] == \
        [[d.model_input.length, width] for d in data]
    assert result.metrics["loss:sum"] > 0


def test_custom_loss_puts_minus_its_gradient_into_a_cross_entropy_surrogate(service_client):
    data = sft_data(3)
    custom = service_client.create_lora_training_client("tiny", rank=4, seed=7).result()
    builtin = service_client.create_lora_training_client("tiny", rank=4, seed=7).result()

    def neg_ll(batch, logprobs_list):
        loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum()
                   for d, lp in zip(batch, logprobs_list, strict=True))
        return loss, {"custom/neg_ll:sum": loss.detach().item()}

    out = custom.forward_backward_custom(data, neg_ll)
    custom_step = custom.optim_step(ADAM)
    reference = builtin.forward_backward(data, "cross_entropy").result()
    builtin_step = builtin.optim_step(ADAM)
    result = out.result()
    # Two models whose passes the server may merge or not: float32 rounding apart.
    assert result.metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"],
                                                       rel=LOSS_RTOL)
    assert result.metrics["surrogate_loss:sum"] == pytest.approx(result.metrics["loss:sum"],
                                                                 rel=1e-5)
    assert "custom/neg_ll:sum" in result.metrics
    custom_step.result(), builtin_step.result()
    # Same gradient, same step: the two adapters now give the same loss.
    assert custom.forward(data, "cross_entropy").result().metrics["loss:sum"] == \
        pytest.approx(builtin.forward(data, "cross_entropy").result().metrics["loss:sum"],
                      rel=LOSS_RTOL)
