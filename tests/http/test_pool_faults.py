"""Faults of the continuous-batching decode pool, end to end through the stock `tinker`
SDK over HTTP with two tenants and their own keys (issue 30; DESIGN.md, "Sampling wing
and its faults": whatever one request does, only that request fails).

A tenant whose adapter diverged (one AdamW step at learning rate 1e30) samples: its
logits are not finite. Its request fails alone, with a user error naming them; the other
tenant's sample already decoding beside it completes, and so does every later sample, of
either tenant, on an adapter or on the base.

The case starts its own server: a pool left broken must not decide any other test of
the package. (`/metrics` reading the pool while it runs is pinned at engine level, where
the race it had showed every run: tests/engine/sampling/test_pool.py.)
"""

from __future__ import annotations

import math
import re
import time

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from twinkle_server.process import start_server

from ..service.harness import create_key
from .conftest import sft_data

pytestmark = pytest.mark.integration

DIVERGING_LEARNING_RATE = 1e30
"""One Adam step at this rate moves the adapter's weights by ~1e30: its activations
overflow float32 and its logits are NaN (checked below, through the
adapter's own forward pass, before anything is sampled)."""
NON_FINITE = re.compile(r"not finite|non-finite", re.I)
RESULT_TIMEOUT_S = 300
"""A hang guard: a sample on the tiny model takes well under a second quiet, but the
512-step one below ran past 60 s beside two CPU burners and three other test jobs
(2026-12-06, load above 8 on 2 cores); five minutes is a hang on any machine."""
LONG_MAX_TOKENS = 512
"""Tenant B's sample that is decoding when A's joins, EOS off (`stop=[]`): 512 steps take
~1.5 s on the tiny model on 2 CPU cores, many decode slices (100 ms each) after A's
joined; 64 may end in the very slice A joins."""

@pytest.fixture
def keyed_server(tmp_path_factory, tiny_cache):
    """A fresh server with its HTTP front; tenants alice and bob, each with a `tml-` key
    made by the CLI (as tests/http/conftest.py's package server, but one per case)."""
    data_dir = tmp_path_factory.mktemp("pool-faults")
    keys = {tenant: create_key(data_dir, tenant) for tenant in ("alice", "bob")}
    proc = start_server(data_dir, http=True)
    proc.keys = keys
    yield proc
    proc.stop()


@pytest.fixture
def tenants(keyed_server):
    """(base URL, alice's ServiceClient, bob's ServiceClient)."""
    base_url = f"http://{keyed_server.http_address}"
    alice = tinker.ServiceClient(base_url=base_url, api_key=keyed_server.keys["alice"])
    bob = tinker.ServiceClient(base_url=base_url, api_key=keyed_server.keys["bob"])
    yield base_url, alice, bob
    for client in (alice, bob):
        client.close("success").result()


def _gauge(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return next(s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == name)


def _outcome(future) -> types.SampleResponse | BaseException:
    """The future's response, or what it raised (so every outcome is seen before any is
    asserted)."""
    try:
        return future.result(timeout=RESULT_TIMEOUT_S)
    except Exception as exc:   # noqa: BLE001 - reported, then asserted on
        return exc


def _describe(outcome: object) -> str:
    if isinstance(outcome, BaseException):
        return f"raised {type(outcome).__name__}: {outcome}"
    return f"answered {[(len(s.tokens), s.stop_reason) for s in outcome.sequences]}"


def _is_user_error(exc: BaseException) -> bool:
    """A failure the SDK reports as the caller's: a `RequestFailedError` of category
    user, or a 4xx status (the SDK's 5xx classes are `APIStatusError`s too)."""
    if isinstance(exc, tinker.RequestFailedError):
        return exc.category == types.RequestErrorCategory.User
    return isinstance(exc, tinker.APIStatusError) and exc.status_code < 500


def test_a_diverged_adapter_fails_its_own_sample_and_every_other_tenants_sample_completes(
        keyed_server, tenants):
    base_url, alice, bob = tenants
    diverged = alice.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    diverged.forward_backward(sft_data(n=2), "cross_entropy").result()
    diverged.optim_step(types.AdamParams(learning_rate=DIVERGING_LEARNING_RATE)).result()
    # Precondition: the adapter really is diverged (its own forward pass says so).
    try:
        out = diverged.forward(sft_data(n=1), "cross_entropy").result()
    except tinker.RequestFailedError as exc:
        assert NON_FINITE.search(str(exc)), f"forward failed otherwise: {exc}"
    else:
        logprobs = [float(v) for o in out.loss_fn_outputs for v in o["logprobs"].tolist()]
        assert not all(map(math.isfinite, logprobs)), "1e30 did not diverge the adapter"
    alice_sampler = diverged.save_weights_and_get_sampling_client().result()

    healthy = bob.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    healthy.forward_backward(sft_data(n=2, seed=1), "cross_entropy").result()
    healthy.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    bob_sampler = healthy.save_weights_and_get_sampling_client().result()

    prompt = types.ModelInput.from_ints([5, 6, 7, 8, 9, 10])
    long = types.SamplingParams(max_tokens=LONG_MAX_TOKENS, temperature=1.0, seed=3, stop=[])
    short = types.SamplingParams(max_tokens=4, temperature=1.0, seed=4, stop=[])
    bob_inflight = bob_sampler.sample(prompt, 2, long)
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while _gauge(base_url, "twinkle_decode_rows_active") < 2:
        assert time.monotonic() < deadline and not bob_inflight.future().done(), (
            f"bob's long sample never showed in the pool: {_describe(_outcome(bob_inflight))}")
        time.sleep(0.005)
    alice_diverged = _outcome(alice_sampler.sample(prompt, 1, short))
    bob_decoding_then = not bob_inflight.future().done()
    bob_then = _outcome(bob_inflight)
    bob_later = _outcome(bob_sampler.sample(prompt, 1, short))
    base_later = _outcome(alice.create_sampling_client(base_model="tiny").result()
                          .sample(prompt, 1, short))
    seen = (f"alice's diverged sample {_describe(alice_diverged)}; bob's in-flight sample "
            f"(still decoding when alice's failed: {bob_decoding_then}) "
            f"{_describe(bob_then)}; bob's later sample {_describe(bob_later)}; a later "
            f"base sample {_describe(base_later)}\nserver log tail:\n"
            f"{keyed_server.log()[-3000:]}")

    assert isinstance(alice_diverged, BaseException), seen
    assert NON_FINITE.search(str(alice_diverged)) and _is_user_error(alice_diverged), seen
    assert not isinstance(bob_then, BaseException), seen
    assert bob_decoding_then, seen   # else the two never shared the pool: no test of it
    assert [(len(s.tokens), s.stop_reason) for s in bob_then.sequences] == \
        [(LONG_MAX_TOKENS, "length")] * 2, seen
    for later in (bob_later, base_later):
        assert not isinstance(later, BaseException), seen
        assert len(later.sequences[0].tokens) == 4, seen
    assert _gauge(base_url, "twinkle_decode_rows_active") == 0

