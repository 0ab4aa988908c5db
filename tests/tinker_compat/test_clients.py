"""The rest of the surface against a real server: sampling semantics, tokenizer, the
back-compat client futures, and the RestClient's runs, checkpoints and downloads."""

from __future__ import annotations

import warnings

import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from tinker_compat import RestClient, SamplingClient, ServiceClient, TrainingClient

from ..numerics import LOGPROB_ATOL, assert_rows_alike, neighbours_could_draw, sdk_score
from .conftest import sft_data

pytestmark = pytest.mark.integration

PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])


def test_sampling_is_seeded_stop_empty_runs_to_max_tokens_and_logprobs_line_up(
        service_client):
    sampling_client = service_client.create_sampling_client(base_model="tiny").result()
    assert isinstance(sampling_client, SamplingClient)
    assert sampling_client.get_base_model() == "tiny"
    params = types.SamplingParams(max_tokens=7, seed=11, stop=[], top_k=-1)
    first = sampling_client.sample(PROMPT, 3, params, include_prompt_logprobs=True).result()
    again = sampling_client.sample(prompt=PROMPT, num_samples=3, sampling_params=params).result()
    # The same request and seed, alone both times; the second reuses the first's prompt
    # KV (one sampling session), computed in another shape: the same tokens up to a near
    # tie (tests/numerics.py), logprobs within LOGPROB_ATOL up to there.
    assert_rows_alike(first.sequences, again.sequences, lambda row: neighbours_could_draw(
        first.sequences[row].tokens, sdk_score(sampling_client, PROMPT.to_ints())))
    for sequence in first.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs) == 7
        assert sequence.stop_reason == "length"
    scored = sampling_client.compute_logprobs(PROMPT).result()
    assert scored[0] is None and first.prompt_logprobs[0] is None
    assert scored[1:] == pytest.approx(first.prompt_logprobs[1:], abs=LOGPROB_ATOL)
    assert again.prompt_logprobs is None and again.topk_prompt_logprobs is None
    with pytest.raises(ValueError, match="topk_prompt_logprobs"):
        sampling_client.sample(PROMPT, 1, params, topk_prompt_logprobs=-1)


def test_topk_prompt_logprobs_list_the_most_likely_tokens_with_none_first(service_client):
    sampling_client = service_client.create_sampling_client(base_model="tiny").result()
    params = types.SamplingParams(max_tokens=2, seed=0)
    result = sampling_client.sample(PROMPT, 1, params, include_prompt_logprobs=True,
                                    topk_prompt_logprobs=3).result()
    topk = result.topk_prompt_logprobs
    assert len(topk) == PROMPT.length and topk[0] is None
    for position, alternatives in enumerate(topk[1:], start=1):
        assert len(alternatives) == 3
        logprobs = [lp for _, lp in alternatives]
        assert logprobs == sorted(logprobs, reverse=True)
        # The prompt's own token is no likelier than the best alternative.
        assert result.prompt_logprobs[position] <= logprobs[0] + 1e-6
    with pytest.raises(tinker.BadRequestError, match=r"topk_prompt_logprobs: must be in \[0, 20\]"):
        sampling_client.sample(PROMPT, 1, params, topk_prompt_logprobs=21).result()


def test_tokenizer_comes_from_the_server_and_round_trips_text(service_client):
    training_client = service_client.create_lora_training_client("tiny", rank=4).result()
    tokenizer = training_client.get_tokenizer()
    ids = tokenizer.encode("hello twinkle")
    assert ids and tokenizer.decode(ids) == "hello twinkle"


def test_using_the_creation_future_as_the_client_works_with_a_future_warning(base_url):
    with pytest.warns(FutureWarning, match="ignores unsupported arguments: timeout"):
        service_client = ServiceClient(base_url=base_url, timeout=5)
    try:
        future = service_client.create_lora_training_client("tiny", rank=4)
        assert isinstance(future, tinker.APIFuture) and isinstance(future, TrainingClient)
        with pytest.warns(FutureWarning, match="Using the future as the TrainingClient"):
            result = future.forward_backward(sft_data(1), "cross_entropy").result()
        assert result.metrics["loss:sum"] > 0
        with pytest.warns(FutureWarning, match=r"Reading `.model_id`"):
            assert future.model_id == future.result().model_id
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            client = future.result()
            assert client.forward(sft_data(1), "cross_entropy").result().metrics
    finally:
        service_client.close()


def test_rest_client_pages_runs_lists_downloads_and_deletes_checkpoints(service_client,
                                                                        base_url, tmp_path):
    training_client = service_client.create_lora_training_client(
        "tiny", rank=4, train_unembed=False, user_metadata={"purpose": "rest"}).result()
    saved = training_client.save_state("r1", user_metadata={"k": "v"}).result().path
    sampler = training_client.save_weights_for_sampler("r1-s").result().path
    with RestClient(base_url=base_url) as rest:
        run = rest.get_training_run(training_client.model_id).result()
        assert isinstance(run, types.TrainingRun)
        assert (run.base_model, run.lora_rank, run.user_metadata) == ("tiny", 4,
                                                                      {"purpose": "rest"})
        assert run.last_checkpoint.tinker_path == saved
        assert run.last_sampler_checkpoint.tinker_path == sampler
        page = rest.list_training_runs(limit=1).result()
        assert len(page.training_runs) == 1 and page.cursor.total_count >= 1
        listed = rest.list_checkpoints(training_client.model_id).result().checkpoints
        assert {c.tinker_path for c in listed} == {saved, sampler}
        assert {c.checkpoint_id: c.checkpoint_type for c in listed} == {
            "weights/r1": "training", "sampler_weights/r1-s": "sampler"}
        info = rest.get_weights_info_by_tinker_path(saved).result()
        assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)
        assert (info.train_attn, info.train_mlp, info.train_unembed) == (True, True, False)
        folder = rest.download_checkpoint(sampler, tmp_path / "adapter").result()
        assert load_file(str(folder / "adapter_model.safetensors"))
        rest.delete_checkpoint(training_client.model_id, "weights/r1").result()
        rest.delete_checkpoint_from_tinker_path(sampler.replace("tinker://", "twinkle://")
                                                ).result()
        assert rest.list_checkpoints(training_client.model_id).result().checkpoints == []
        with pytest.raises(tinker.NotFoundError):
            rest.get_training_run("run-none").result()


def test_saving_a_name_again_conflicts_unless_overwrite_replaces_it(service_client,
                                                                    tmp_path):
    training_client = service_client.create_lora_training_client("tiny", rank=4).result()
    rest = RestClient(base_url=service_client._conn.base_url)
    first = training_client.save_state("latest").result().path
    before = rest.download_checkpoint(first, tmp_path / "before").result()
    with pytest.raises(tinker.ConflictError, match="'latest' already exists"):
        training_client.save_state("latest").result()
    training_client.forward_backward(sft_data(1), "cross_entropy").result()
    training_client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    again = training_client.save_state("latest", overwrite=True).result().path
    assert again == first
    listed = rest.list_checkpoints(training_client.model_id).result().checkpoints
    assert [c.tinker_path for c in listed] == [first]
    after = rest.download_checkpoint(first, tmp_path / "after").result()
    old = load_file(str(before / "adapter_model.safetensors"))
    new = load_file(str(after / "adapter_model.safetensors"))
    assert any(not (old[k] == new[k]).all() for k in old)  # the trained weights replaced them
