"""The SDK's RestClient (runs, checkpoints, sessions) over HTTP, and `/metrics`."""

from __future__ import annotations

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from .conftest import sft_data

pytestmark = pytest.mark.integration


def _samples(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _key(name: str, **labels: str) -> tuple[str, tuple]:
    """A sample's key: every series carries its served model (`base_model`)."""
    return name, tuple(sorted({"base_model": "tiny", **labels}.items()))


def test_runs_and_checkpoints(service, server, base_url):
    tc = service.create_lora_training_client(base_model="tiny", rank=4, train_mlp=False,
                                             user_metadata={"team": "a"}).result()
    tc.forward_backward(sft_data(n=1), "cross_entropy").result()
    saved = tc.save_state("keep").result().path
    doomed = tc.save_state("drop").result().path
    run_id = saved.split("/")[2]
    rest = tinker.RestClient(base_url=base_url, api_key=server.keys["alice"])
    run = rest.get_training_run(run_id).result()
    assert run.training_run_id == run_id and run.lora_rank == 4
    assert run.user_metadata == {"team": "a"} and run.last_checkpoint is not None
    runs = rest.list_training_runs(limit=100).result()
    assert run_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count >= 1
    paths = [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints]
    assert saved in paths and doomed in paths
    rest.delete_checkpoint_from_tinker_path(doomed).result()
    paths = [c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints]
    assert saved in paths and doomed not in paths
    everything = rest.list_user_checkpoints(limit=100).result()
    assert saved in [c.tinker_path for c in everything.checkpoints]
    session = rest.get_session(service.holder.get_session_id()).result()
    assert run_id in session.training_run_ids
    info = rest.get_weights_info_by_tinker_path(saved).result()
    assert info.base_model == "tiny" and info.lora_rank == 4
    assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, False, True)


def test_metrics_move_with_traffic(service, base_url):
    before = _samples(base_url)
    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    tc.forward_backward(sft_data(n=2), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = _samples(base_url)

    def delta(name, **labels):
        key = _key(name, **labels)
        return after.get(key, 0.0) - before.get(key, 0.0)
    assert delta("twinkle_ops_total", kind="forward_backward", outcome="ok") == 1
    assert delta("twinkle_ops_total", kind="optim_step", outcome="ok") == 1
    assert delta("twinkle_tokens_trained_total") == 32
    assert delta("twinkle_op_seconds_count", kind="optim_step") == 1
    # The forward_backward was one pass, counted by how many tenants it carried (here
    # one); the optim_step is no pass of merged ops.
    assert sum(after.get(_key("twinkle_passes_by_tenants_total", tenants=str(n)), 0.0)
               - before.get(_key("twinkle_passes_by_tenants_total", tenants=str(n)), 0.0)
               for n in range(1, 9)) == 1
    assert after[_key("twinkle_adapters_loaded")] >= 1
    assert _key("twinkle_queue_depth") in after
    # Totals since start are counters (once gauges, which rate() must not be given).
    types_of = {f.name: f.type for f in text_string_to_metric_families(
        httpx.get(f"{base_url}/metrics").text)}
    assert types_of["twinkle_passes"] == types_of["twinkle_merged_ops"] == "counter"
    assert delta("twinkle_passes_total") >= 2
    assert not any("tenant" in dict(labels) or "model" in dict(labels)
                   or "session" in dict(labels) for _, labels in after)


def test_metrics_show_the_decode_pool_and_queue_waits(service, base_url):
    before = _samples(base_url)
    tc = service.create_lora_training_client(base_model="tiny", rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(list(range(5, 25)))
    sampler.sample(prompt, 4, types.SamplingParams(max_tokens=6, seed=1)).result()
    tc.forward_backward(sft_data(n=1), "cross_entropy").result()
    after = _samples(base_url)

    def delta(name, **labels):
        key = _key(name, **labels)
        return after.get(key, 0.0) - before.get(key, 0.0)
    # Four samples of one 20-token prompt: it is prefilled once.
    assert delta("twinkle_prompt_tokens_computed_total") == 20
    assert delta("twinkle_decode_tokens_total") >= 4
    assert delta("twinkle_ops_started_total", kind="sample") == 1
    assert delta("twinkle_ops_started_total", kind="forward_backward") == 1
    assert delta("twinkle_queue_wait_seconds_total", kind="sample") >= 0
    assert after[_key("twinkle_kv_pool_positions")] > 0
    assert after[_key("twinkle_decode_rows_active")] == 0
