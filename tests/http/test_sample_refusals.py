"""A bad sampling parameter is refused at once, with a 400 naming the field and its limit,
never accepted and failed later as a future (`runtime.sampling` checks each rule once,
before anything is queued).

The stock SDK raises `BadRequestError` for a 400 at submission and `RequestFailedError`
for a failed future, so `pytest.raises(tinker.BadRequestError)` tells the two apart; the
raw posts check the status itself.
"""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.integration
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])
VOCAB = 4096           # the tiny model's (`engine.tiny_model`)
MAX_SEQ_LEN = 4096     # its max_position_embeddings, the server's --max-seq-len here


@pytest.fixture(scope="module")
def sampler(service):
    return service.create_sampling_client(base_model="tiny").result()


@pytest.fixture(scope="module")
def http(server, base_url):
    with httpx.Client(base_url=base_url, headers={"X-API-Key": server.keys["alice"]},
                      timeout=60) as client:
        yield client


def _asample(http: httpx.Client, sampler, prompt=(5, 6, 7, 8), num_samples: int = 1,
             **params) -> httpx.Response:
    return http.post("/api/v1/asample", json={
        "sampling_session_id": sampler._sampling_session_id, "num_samples": num_samples,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(prompt)}]},
        "sampling_params": {"max_tokens": 2, **params}})


BAD = [
    ({"top_p": 0.0}, 1, (5, 6), "sampling_params.top_p: must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, 1, (5, 6), "sampling_params.top_p: must be in (0, 1], got 1.5"),
    ({"temperature": -1.0}, 1, (5, 6), "sampling_params.temperature: must be finite and >= 0"),
    ({"top_k": -2}, 1, (5, 6), "sampling_params.top_k: must be >= 0 (or -1 = no limit)"),
    ({"max_tokens": -1}, 1, (5, 6), "sampling_params.max_tokens: must be >= 1, got -1"),
    ({"max_tokens": MAX_SEQ_LEN}, 1, (5, 6),
     f"over the {MAX_SEQ_LEN}-token limit (--max-seq-len)"),
    ({}, 10**6, (5, 6), "num_samples: 1000000 x (prompt + max_tokens)"),
    ({}, 1, (5, VOCAB), f"prompt: token ids must lie in [0, {VOCAB})"),
    ({}, 1, (), "prompt: is empty"),
    # 0 is a count like any other, not "left out": refused as a negative one is.
    ({}, 0, (5, 6), "num_samples: must be >= 1, got 0"),
    ({"max_tokens": 0}, 1, (5, 6), "sampling_params.max_tokens: must be >= 1, got 0"),
    # Seeds as the OpenAI route takes them; out of range, not a failed future.
    ({"seed": 2**70}, 1, (5, 6),
     f"sampling_params.seed: {2**70}; give an integer in [0, 2^63)"),
    ({"seed": -1}, 1, (5, 6), "sampling_params.seed: -1; give an integer in [0, 2^63)"),
    ({}, 1, (5, 2**70), f"prompt: token id {2**70} is outside int64"),
]


@pytest.mark.parametrize(("params", "num_samples", "prompt", "says"), BAD,
                         ids=[f"{p}-{n}-{len(t)}" for p, n, t, _ in BAD])
def test_a_bad_parameter_is_a_400_at_once_naming_it(http, sampler, params, num_samples,
                                                   prompt, says):
    reply = _asample(http, sampler, prompt, num_samples, **params)
    assert reply.status_code == 400, reply.text
    assert says in reply.json()["detail"], reply.text


@pytest.mark.parametrize(("params", "says"), [
    (types.SamplingParams(max_tokens=2, top_p=0.0), "sampling_params.top_p"),
    (types.SamplingParams(max_tokens=2, temperature=-0.5), "sampling_params.temperature"),
    (types.SamplingParams(max_tokens=MAX_SEQ_LEN), "--max-seq-len"),
])
def test_the_stock_sdk_raises_bad_request_not_a_failed_future(sampler, params, says):
    with pytest.raises(tinker.BadRequestError, match=says):
        sampler.sample(PROMPT, 1, params).result(timeout=60)


def test_a_huge_num_samples_through_the_sdk_is_a_bad_request(sampler):
    with pytest.raises(tinker.BadRequestError, match="num_samples: 100000 x"):
        sampler.sample(PROMPT, 100_000, types.SamplingParams(max_tokens=2)).result(timeout=60)


def test_an_out_of_vocabulary_token_through_the_sdk_is_a_bad_request(sampler):
    with pytest.raises(tinker.BadRequestError, match=rf"prompt: token ids must lie in \[0, "
                                                     rf"{VOCAB}\)"):
        sampler.sample(types.ModelInput.from_ints([5, VOCAB + 7]), 1,
                       types.SamplingParams(max_tokens=2)).result(timeout=60)


@pytest.mark.parametrize("field", ["prompt_logprobs", "record_stability_info"])
@pytest.mark.parametrize("value", ["no", 0, 1, []])
def test_a_flag_that_is_not_true_or_false_is_refused_by_name(http, sampler, field, value):
    reply = http.post("/api/v1/asample", json={
        "sampling_session_id": sampler._sampling_session_id, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
        "sampling_params": {"max_tokens": 2}, field: value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["detail"] == f"{field}: must be true or false, got {value!r}"


def test_the_session_still_samples_after_the_refusals(sampler):
    reply = sampler.sample(PROMPT, 2, types.SamplingParams(max_tokens=2, seed=0)).result()
    assert [len(s.tokens) for s in reply.sequences] == [2, 2]

