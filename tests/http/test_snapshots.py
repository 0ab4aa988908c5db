"""Ephemeral sampler weights through the stock SDK over HTTP: the sampling client of
`save_weights_and_get_sampling_client()` samples the weights of its moment, is no
checkpoint (not listed by run or by user, no path), and its weights are deleted when its
session ends."""

from __future__ import annotations

import pytest
import tinker
from tinker import types

from ..numerics import assert_alike_until_a_near_tie, topk_greedy_could_draw
from .conftest import sft_data

pytestmark = pytest.mark.integration
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)


def test_ephemeral_sampler_weights_are_not_listed_and_go_with_their_session(
        server, base_url):
    snapshots = server.data_dir / "sampler-snapshots"
    before = set(snapshots.iterdir()) if snapshots.exists() else set()
    own = tinker.ServiceClient(base_url=base_url, api_key=server.keys["alice"])
    rest = tinker.RestClient(base_url=base_url, api_key=server.keys["alice"])
    tc = own.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    samplers = []
    for _ in range(2):   # one per RL step
        tc.forward_backward(sft_data(), "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2))
        samplers.append(tc.save_weights_and_get_sampling_client().result())
    named = tc.save_weights_for_sampler("kept").result().path
    # With their top 2: the live checkpoint's greedy tokens are the last snapshot's up to a
    # near tie (the same weights through another adapter slot; tests/numerics.py).
    sampled = [s.sample(PROMPT, 1, GREEDY, topk_sample_logprobs=2).result().sequences[0]
               for s in samplers]
    live = own.create_sampling_client(model_path=named).result()
    assert_alike_until_a_near_tie(sampled[-1], live.sample(PROMPT, 1, GREEDY).result()
                                  .sequences[0], topk_greedy_could_draw(sampled[-1]))

    ids = [s._sampling_session_id for s in samplers]
    assert [rest.get_sampler(i).result().model_path for i in ids] == [None, None]
    listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
    assert listed == [named]
    everything = rest.list_user_checkpoints(limit=1000).result()
    assert not [c for c in everything.checkpoints if "ephemeral" in c.tinker_path]
    mine = set(snapshots.iterdir()) - before
    assert {p.name for p in mine} == set(ids)

    own.close("success").result()
    assert not any(p.exists() for p in mine)
    for sampler_id in ids:
        with pytest.raises(tinker.NotFoundError, match="no sampling session"):
            rest.get_sampler(sampler_id).result()
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] \
        == [named]
