"""A server on two ranks (FSDP2 over gloo, `--nproc-per-node 2`) against one on one rank:
the same seeds and data give the same numbers, through both clients, and each rank holds
half of the base.

Tolerances (`tests/numerics.py`): the two servers run the same math over different GEMM
shapes (each rank runs half of a pass's datums), so they agree to float32 rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel
from safetensors.numpy import load_file
from tinker import types
from transformers import AutoModelForCausalLM

from tests.numerics import (
    LOGPROB_ATOL,
    LOSS_RTOL,
    assert_alike_until_a_near_tie,
    assert_trained_alike,
    neighbours_could_draw,
    sdk_score,
)
from tinker_compat import RestClient, ServiceClient
from twinkle_client import init_twinkle_client
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_server.engine.tiny_model import build_tiny_model
from twinkle_server.process import start_server

from ..client.conftest import toy_features
from ..tinker_compat.conftest import sft_data

pytestmark = pytest.mark.integration

LR = 1e-3
STEPS = 3
FLAGS = ("--max-adapters-per-tenant", "16", "--max-pass-tokens", "32", "--max-seq-len", "32")
TWO_RANKS = ("--nproc-per-node", "2", "--collective-timeout", "60")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_cache):
    """One server on one rank and one on two, same flags otherwise. Passes run in pieces
    of at most 32 tokens, so a merged pass runs in several pieces on each rank (and the
    native loop's in one piece a rank on two ranks, several on one)."""
    one = start_server(tmp_path_factory.mktemp("one-rank"), *FLAGS)
    two = start_server(tmp_path_factory.mktemp("two-ranks"), *FLAGS, *TWO_RANKS)
    yield one, two
    assert two.stop() == 0, two.log()[-3000:]
    one.stop()


def _rl_data(seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for datum in sft_data(n=3, length=10 + seed, seed=seed):
        n = len(datum.loss_fn_inputs["target_tokens"].data)
        data.append(types.Datum(model_input=datum.model_input, loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "logprobs": rng.normal(-3, 0.5, n).astype(np.float32),
            "advantages": rng.normal(0, 1, n).astype(np.float32)}))
    return data


def _train_two_tenants(address: str, tmp_path) -> dict:
    """Two models trained in merged passes: cross_entropy and importance_sampling."""
    service = ServiceClient(base_url=f"http://{address}")
    try:
        sft = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        rl = service.create_lora_training_client(base_model="tiny", rank=8, seed=2).result()
        sft_batch, rl_batch = sft_data(n=5, length=12, seed=3), _rl_data(4)
        losses, logprobs = [], []
        for _ in range(STEPS):
            # Both submitted before either is awaited, so the scheduler merges them.
            a = sft.forward_backward(sft_batch, "cross_entropy")
            b = rl.forward_backward(rl_batch, "importance_sampling")
            out_a, out_b = a.result(), b.result()
            sft.optim_step(types.AdamParams(learning_rate=LR)).result()
            rl.optim_step(types.AdamParams(learning_rate=LR)).result()
            losses.append((out_a.metrics["loss:sum"], out_b.metrics["loss:sum"]))
            logprobs.append([o["logprobs"].to_numpy() for out in (out_a, out_b)
                             for o in out.loss_fn_outputs])
        rest = RestClient(base_url=f"http://{address}")
        weights = []
        for client, name in ((sft, "sft"), (rl, "rl")):
            path = client.save_weights_for_sampler(name).result().path
            folder = rest.download_checkpoint(path, tmp_path / address.replace(":", "_") / name)
            weights.append(load_file(str(folder.result() / "adapter_model.safetensors")))
        return {"losses": losses, "logprobs": logprobs, "weights": weights}
    finally:
        service.close()


def _assert_trained_alike(got: dict, want: dict) -> None:
    """Two `_train_two_tenants` runs through passes of other shapes: losses, logprobs and
    trained weights within `tests/numerics.py`'s bounds."""
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=LOSS_RTOL)
    for got_run, want_run in zip(got["logprobs"], want["logprobs"], strict=True):
        for a, b in zip(got_run, want_run, strict=True):
            np.testing.assert_allclose(a, b, atol=LOGPROB_ATOL, rtol=0)
    for a, b in zip(got["weights"], want["weights"], strict=True):
        assert_trained_alike(a, b, LR, STEPS)


def test_two_tenants_merged_train_on_two_ranks_as_on_one(servers, tmp_path):
    one, two = (_train_two_tenants(s.address, tmp_path) for s in servers)
    _assert_trained_alike(two, one)


def test_two_tenants_on_two_ranks_with_one_resident_slot_train_as_with_all_resident(
        servers, tmp_path, tiny_cache):
    """`--max-adapters 1` on two ranks: each merged pass of the two models runs in two
    pieces, each paging its adapter in on every rank at the same op (adapters are
    replicated), and the runs train as on the two-rank server that keeps both resident.
    Another pass shape, so the bounds of the one-rank comparison, not bit equality."""
    paged = start_server(tmp_path / "one-slot", *FLAGS, *TWO_RANKS, "--max-adapters", "1")
    try:
        got = _train_two_tenants(paged.address, tmp_path)
    finally:
        assert paged.stop() == 0, paged.log()[-3000:]
    _assert_trained_alike(got, _train_two_tenants(servers[1].address,
                                                  tmp_path / "resident"))


def _native_loop(address: str, tmp_path) -> tuple[list[float], dict]:
    """The native client's loop: CrossEntropyLoss, accumulation 2, 4 micro-batches."""
    with init_twinkle_client(base_url=f"http://{address}", api_key="EMPTY_TOKEN") as client:
        model = MultiLoraTransformersModel("ms://tiny")
        model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8,
                                                         target_modules="all-linear"),
                                   gradient_accumulation_steps=2, seed=5)
        model.set_loss("CrossEntropyLoss")
        model.set_optimizer("AdamW", lr=LR)
        losses = []
        for step in range(4):
            batch = toy_features(3, length=10 + 3 * step, seed=step)
            losses.append(model.forward_backward(inputs=batch).loss)
            model.clip_grad_norm(1.0)
            model.step()
            model.zero_grad()
        folder = client.download_checkpoint(model.save("native"),
                                            tmp_path / address.replace(":", "_"))
        return losses, load_file(str(folder / "adapter_model.safetensors"))


def test_native_loop_with_accumulation_trains_on_two_ranks_as_on_one(servers, tmp_path):
    (loss_one, w_one), (loss_two, w_two) = (_native_loop(s.address, tmp_path) for s in servers)
    np.testing.assert_allclose(loss_two, loss_one, rtol=LOSS_RTOL)
    assert_trained_alike(w_two, w_one, LR, 2)


def _sampler_after_one_step(service: ServiceClient, seed: int, n: int, name: str = "") -> Any:
    """A sampling client of a new model trained one step on `n` datums: on sampler weights
    saved as `name`, else on ephemeral ones (no path)."""
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
    training.forward_backward(sft_data(n=n, seed=seed + 1), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    if not name:
        return training.save_weights_and_get_sampling_client().result()
    path = training.save_weights_for_sampler(name).result().path
    return service.create_sampling_client(model_path=path).result()


PROMPT = [5, 17, 29, 3, 88]


def _sample(service):
    """A seeded sample of one step's weights, its prompt's logprobs, and the sampler."""
    # One datum: one rank has none and runs a token of padding through the layers.
    sampler = _sampler_after_one_step(service, seed=7, n=1)
    prompt = types.ModelInput.from_ints(PROMPT)
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=11,
                                                         temperature=1.0)).result()
    return out.sequences[0], sampler.compute_logprobs(prompt).result()[1:], sampler


def test_seeded_sampling_and_logprobs_on_two_ranks_match_one(servers):
    """The same seeded draws on logits a rounding apart (each rank's share of the pass):
    one rank's tokens up to a near tie, logprobs within LOGPROB_ATOL up to there."""
    services = [ServiceClient(base_url=f"http://{s.address}") for s in servers]
    try:
        (one, prompt_one, sampler), (two, prompt_two, _) = (_sample(s) for s in services)
        assert_alike_until_a_near_tie(one, two, neighbours_could_draw(
            one.tokens, sdk_score(sampler, PROMPT)))
        np.testing.assert_allclose(prompt_two, prompt_one, atol=LOGPROB_ATOL, rtol=0)
    finally:
        for service in services:
            service.close()


def test_a_checkpoint_saved_on_two_ranks_gives_the_same_logits_in_peft(servers, tiny_cache,
                                                                       tmp_path):
    service = ServiceClient(base_url=f"http://{servers[1].address}")
    try:
        sampler = _sampler_after_one_step(service, seed=9, n=4, name="for-peft")
        tokens = [5, 17, 29, 3, 88, 41, 7]
        served = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
        path = sampler.model_path
        folder = RestClient(base_url=f"http://{servers[1].address}").download_checkpoint(path, tmp_path / "a").result()
    finally:
        service.close()
    base_dir = build_tiny_model(tiny_cache)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(folder)).eval()
    with torch.no_grad():
        logits = peft(input_ids=torch.tensor([tokens])).logits[0].float()
    want = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(tokens[1:])[:, None])
    np.testing.assert_allclose(served, want[:, 0].numpy(), atol=LOGPROB_ATOL, rtol=0)


def _resumed_logprobs(address: str) -> list[np.ndarray]:
    """Train a step, save with the optimizer, resume into a new model, train a step."""
    service = ServiceClient(base_url=f"http://{address}")
    try:
        first = service.create_lora_training_client(base_model="tiny", rank=4, seed=12).result()
        first.forward_backward(sft_data(n=3, seed=13), "cross_entropy").result()
        first.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = first.save_state("resume").result().path
        resumed = service.create_training_client_from_state_with_optimizer(state).result()
        resumed.forward_backward(sft_data(n=3, seed=14), "cross_entropy").result()
        resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        out = resumed.forward(sft_data(n=2, seed=15), "cross_entropy").result()
        return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    finally:
        service.close()


def test_a_state_saved_and_resumed_on_two_ranks_trains_on_as_on_one(servers):
    one, two = (_resumed_logprobs(s.address) for s in servers)
    for a, b in zip(two, one, strict=True):
        np.testing.assert_allclose(a, b, atol=LOGPROB_ATOL, rtol=0)
