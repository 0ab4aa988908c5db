"""The sampler's prefix cache through the shim over gRPC, on a server with two tenants:
within one sampling session a prompt that extends an earlier one (a multi-turn rollout)
reuses its KV (`prompt_cache_hit_tokens`) and samples what a fresh session samples; a
new session, and another tenant's session on the same weights, start with nothing
cached. The pool's own rules are tests/engine/sampling/test_pool.py."""

from __future__ import annotations

import pytest
from tinker import types

from tinker_compat import RestClient, ServiceClient
from twinkle_server.process import start_server

from ..numerics import assert_alike_until_a_near_tie, neighbours_could_draw, sdk_score
from ..service.harness import create_key

pytestmark = pytest.mark.integration

PROMPT = [5, 6, 7, 8, 9, 10]
REPLY = [40, 41, 42]
"""The next turn's new tokens, after the first turn's completion."""
PARAMS = types.SamplingParams(max_tokens=5, seed=17, stop=[])


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, tiny_cache):
    data_dir = tmp_path_factory.mktemp("prefix-cache")
    keys = {tenant: create_key(data_dir, tenant) for tenant in ("alice", "bob")}
    proc = start_server(data_dir)
    yield f"http://{proc.address}", keys
    proc.stop()


@pytest.fixture(scope="module")
def clients(keyed_server):
    base_url, keys = keyed_server
    with ServiceClient(base_url=base_url, api_key=keys["alice"]) as alice, \
            ServiceClient(base_url=base_url, api_key=keys["bob"]) as bob:
        yield base_url, keys, alice, bob


@pytest.fixture(scope="module", params=["base", "checkpoint"])
def weights(request, clients):
    """Keyword arguments of `create_sampling_client` naming weights both tenants may
    sample: the base, or alice's saved sampler checkpoint, published for bob."""
    base_url, keys, alice, _ = clients
    if request.param == "base":
        return {"base_model": "tiny"}
    trainer = alice.create_lora_training_client("tiny", rank=4, seed=5).result()
    path = trainer.save_weights_for_sampler("prefix-cache").result().path
    with RestClient(base_url=base_url, api_key=keys["alice"]) as rest:
        rest.publish_checkpoint_from_tinker_path(path).result()
    return {"model_path": path}


def sample(client, prompt: list[int]) -> types.SampleResponse:
    return client.sample(types.ModelInput.from_ints(prompt), 1, PARAMS).result()


def test_an_extended_prompt_reuses_its_session_prefix_and_samples_as_a_fresh_session(
        clients, weights):
    _, _, alice, _ = clients
    session = alice.create_sampling_client(**weights).result()
    first = sample(session, PROMPT)
    assert first.prompt_cache_hit_tokens == 0
    completion = list(first.sequences[0].tokens)
    turn = PROMPT + completion + REPLY
    second = sample(session, turn)
    # The first turn's prompt and completion, but its last token (never fed: the cache
    # holds no KV of it).
    assert second.prompt_cache_hit_tokens == len(PROMPT) + len(completion) - 1

    other = alice.create_sampling_client(**weights).result()
    fresh = sample(other, turn)
    assert fresh.prompt_cache_hit_tokens == 0
    # Seeded: the same draws; the cached prefix's KV and the recomputed one differ by
    # rounding (other GEMM shapes), so the tokens agree up to a near tie and the logprobs
    # within LOGPROB_ATOL up to there (tests/numerics.py).
    assert_alike_until_a_near_tie(fresh.sequences[0], second.sequences[0],
                                  neighbours_could_draw(fresh.sequences[0].tokens,
                                                        sdk_score(other, turn)))


def test_no_other_session_or_tenant_starts_from_a_sessions_cached_prefix(clients, weights):
    _, _, alice, bob = clients
    session = alice.create_sampling_client(**weights).result()
    first = sample(session, PROMPT)
    turn = PROMPT + list(first.sequences[0].tokens) + REPLY
    assert sample(session, turn).prompt_cache_hit_tokens > 0   # alice's session holds it

    theirs = bob.create_sampling_client(**weights).result()
    assert sample(theirs, turn).prompt_cache_hit_tokens == 0
    assert sample(theirs, PROMPT).prompt_cache_hit_tokens > 0   # bob's own session's, now
    again = alice.create_sampling_client(**weights).result()
    assert sample(again, turn).prompt_cache_hit_tokens == 0
