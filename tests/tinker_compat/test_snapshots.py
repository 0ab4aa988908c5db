"""Ephemeral sampler weights through the shim over gRPC: the sampling client of
`save_weights_and_get_sampling_client()` samples the weights of its moment, is no
checkpoint (not in the RestClient's listings nor `twinkle-server runs checkpoints`), and
its weights are deleted when its session ends."""

from __future__ import annotations

import pytest
from tinker import types

from tinker_compat import RestClient, ServiceClient
from twinkle_server import cli

from ..numerics import assert_alike_until_a_near_tie, topk_greedy_could_draw
from .conftest import sft_data

pytestmark = pytest.mark.integration
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)


def test_ephemeral_sampler_weights_are_not_listed_and_go_with_their_session(
        server, base_url, capsys):
    snapshots = server.data_dir / "sampler-snapshots"
    before = set(snapshots.iterdir()) if snapshots.exists() else set()
    service_client = ServiceClient(base_url=base_url)
    tc = service_client.create_lora_training_client("tiny", rank=4, seed=1).result()
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
    live = service_client.create_sampling_client(model_path=named).result()
    assert_alike_until_a_near_tie(sampled[-1], live.sample(PROMPT, 1, GREEDY).result()
                                  .sequences[0], topk_greedy_could_draw(sampled[-1]))
    assert [s.model_path for s in samplers] == [None, None]

    with RestClient(base_url=base_url) as rest:
        listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
        everything = [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    assert listed == [named] and named in everything and len(everything) == len(set(everything))
    assert not [p for p in everything if "ephemeral" in p]
    capsys.readouterr()
    assert cli.main(["runs", "checkpoints", tc.model_id, "--data-dir",
                     str(server.data_dir)]) == 0
    table = capsys.readouterr().out
    assert "sampler_weights/kept" in table and len(table.strip().splitlines()) == 2
    mine = set(snapshots.iterdir()) - before
    assert {p.name for p in mine} == {s.sampling_session_id for s in samplers}

    service_client.close()
    assert not any(p.exists() for p in mine)
