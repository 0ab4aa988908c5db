"""The OpenAI-compatible routes (`/oai/api/v1`), driven by the real `openai` package (sync,
async, streaming) against a real server process, and by plain `httpx` for the error
shapes. A checkpoint the stock `tinker` SDK saves is usable there at once, with the same
keys and tenant isolation as the Tinker routes.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from ..numerics import LOGPROB_ATOL
from .conftest import keyed_server, sft_data

pytestmark = pytest.mark.integration

PROMPT_IDS = [5, 17, 29, 3, 88, 41, 7, 12]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    proc = keyed_server(tmp_path_factory.mktemp("oai-server"), "--model-alias",
                        "Qwen/Qwen3-0.6B")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return f"http://{server.http_address}/oai/api/v1"


@pytest.fixture(scope="module")
def client(server, base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=server.keys["alice"], max_retries=0)


@pytest.fixture(scope="module")
def checkpoint(server) -> tuple[str, tinker.SamplingClient]:
    """A sampler checkpoint alice's stock SDK just saved, and its SDK sampling client."""
    service = tinker.ServiceClient(base_url=f"http://{server.http_address}",
                                   api_key=server.keys["alice"])
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    training.forward_backward(sft_data(n=2), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = training.save_weights_for_sampler("for-oai").result().path
    return path, service.create_sampling_client(model_path=path).result()


def test_models_lists_the_bases_and_the_callers_sampler_checkpoints(client, checkpoint):
    path, _ = checkpoint
    ids = [m.id for m in client.models.list().data]
    assert ids[:2] == ["tiny", "Qwen/Qwen3-0.6B"]
    assert path in ids


def test_a_model_is_retrieved_by_its_id_and_another_tenants_is_not_found(server, base_url,
                                                                        client, checkpoint):
    """`models.retrieve` answers the entry `/models` lists, for a base name or alias and a
    checkpoint path (slashes and all); once every id answered 404."""
    path, _ = checkpoint
    listed = {m.id: m for m in client.models.list().data}
    for name in ("tiny", "Qwen/Qwen3-0.6B", path):
        assert client.models.retrieve(name) == listed[name]
    bob = openai.OpenAI(base_url=base_url, api_key=server.keys["bob"], max_retries=0)
    for name in (path, "no-such-model"):
        with pytest.raises(openai.NotFoundError) as missing:
            bob.models.retrieve(name)
        assert (missing.value.body["param"], missing.value.body["code"]) == \
            ("model", "model_not_found")


def test_a_completion_counts_its_usage_exactly_and_is_seeded(client):
    first = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=6,
                                      temperature=1.0, seed=3)
    again = client.completions.create(model="Qwen/Qwen3-0.6B", prompt=PROMPT_IDS,
                                      max_tokens=6, temperature=1.0, seed=3, logprobs=2)
    assert first.choices[0].text == again.choices[0].text
    usage = again.usage
    generated = len(again.choices[0].logprobs.tokens)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT_IDS), generated)
    assert usage.total_tokens == len(PROMPT_IDS) + generated
    assert again.choices[0].finish_reason in ("stop", "length")
    logprobs = again.choices[0].logprobs
    # The two likeliest, and the chosen token where it is not one of them.
    assert all(token in top and len(top) <= 3
               for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True))


def test_the_checkpoints_logprobs_are_the_tinker_samplers(client, checkpoint):
    """The same weights through both doors: the sampled tokens' logprobs agree with the
    SDK's compute_logprobs of prompt + completion (float32 rounding, LOGPROB_ATOL)."""
    path, sampler = checkpoint
    out = client.completions.create(model=path, prompt=PROMPT_IDS, max_tokens=5,
                                    temperature=1.0, seed=1, logprobs=0)
    tokens = out.choices[0].logprobs.tokens
    ids = client_token_ids(out, sampler, len(tokens))
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT_IDS + ids)).result()
    np.testing.assert_allclose(out.choices[0].logprobs.token_logprobs,
                               scored[len(PROMPT_IDS):], atol=LOGPROB_ATOL, rtol=0)
    with_base = client.completions.create(model=f"tiny;{path}", prompt=PROMPT_IDS,
                                          max_tokens=5, temperature=1.0, seed=1)
    assert with_base.choices[0].text == out.choices[0].text


def client_token_ids(out, sampler: tinker.SamplingClient, count: int) -> list[int]:
    """The completion's token ids: the same seeded sample through the Tinker door."""
    sample = sampler.sample(types.ModelInput.from_ints(PROMPT_IDS), 1,
                            types.SamplingParams(max_tokens=5, seed=1,
                                                 temperature=1.0)).result()
    ids = list(sample.sequences[0].tokens)
    assert len(ids) == count
    return ids


def test_chat_goes_through_the_chat_template_and_n_gives_n_choices(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "What is 2 + 2?"}],
        max_completion_tokens=8, n=3, seed=2, logprobs=True, top_logprobs=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in out.choices)
    assert all(len(c.logprobs.content) <= 8 for c in out.choices)
    assert all(len(t.top_logprobs) == 3 for c in out.choices for t in c.logprobs.content)
    # The template's prompt: <|im_start|>system ... <|im_start|>assistant\n.
    assert out.usage.prompt_tokens > 10
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)


def test_a_stream_ends_with_done_and_carries_usage_when_asked(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi."}], max_tokens=6,
        seed=4, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices
              and c.choices[0].finish_reason]
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi."}], max_tokens=6, seed=4)
    assert text == whole.choices[0].message.content
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_async_client_and_stop_sequences(server, base_url):
    async def run():
        client = openai.AsyncOpenAI(base_url=base_url, api_key=server.keys["alice"],
                                    max_retries=0)
        plain = await client.completions.create(model="tiny", prompt="The", max_tokens=12,
                                                seed=9, temperature=1.0)
        cut = plain.choices[0].text[3:5] or plain.choices[0].text[-1:]
        stopped = await client.completions.create(model="tiny", prompt="The", max_tokens=12,
                                                  seed=9, temperature=1.0, stop=[cut])
        await client.close()
        return plain.choices[0].text, stopped.choices[0], cut
    text, stopped, cut = asyncio.run(run())
    assert cut_before(text, stopped.text) and cut not in stopped.text
    assert stopped.finish_reason == "stop"


def cut_before(text: str, stopped: str) -> bool:
    """The stopped text is a prefix of the full one that leaves the stop sequence out."""
    return text.startswith(stopped) and len(stopped) < len(text)


def test_another_tenants_checkpoint_is_not_found_and_a_key_is_needed(server, base_url,
                                                                      checkpoint):
    path, _ = checkpoint
    bob = openai.OpenAI(base_url=base_url, api_key=server.keys["bob"], max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        bob.completions.create(model=path, prompt=PROMPT_IDS, max_tokens=2)
    assert missing.value.body["param"] == "model"
    assert missing.value.body["code"] == "model_not_found"
    nobody = openai.OpenAI(base_url=base_url, api_key="tml-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nobody.models.list()


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "tiny", "prompt": "x", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"model": "tiny", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "tiny", "prompt": "x", "suffix": "end"}, "suffix"),
    ({"model": "tiny", "prompt": "x", "n": 99}, "n"),
    ({"model": "tiny", "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options"),
    ({"model": "tiny", "prompt": [1, 99999]}, "prompt"),
    ({"model": "tiny", "prompt": "x", "mystery": 1}, "mystery"),
    ({"prompt": "x"}, "model"),
    # Each of these once answered 500, or was served as if left out.
    ({"model": "tiny", "prompt": [2**63]}, "prompt"),
    ({"model": "tiny", "prompt": [[5], [2**64]]}, "prompt"),
    ({"model": "tiny", "prompt": "\ud800"}, "prompt"),
    ({"model": "tiny", "prompt": "x", "best_of": True}, "best_of"),
    ({"model": "tiny", "prompt": "x", "frequency_penalty": False}, "frequency_penalty"),
    ({"model": "tiny", "prompt": "x", "stream": True,
      "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    # A value of the wrong kind is refused, not read as left out.
    ({"model": "tiny", "prompt": "x", "suffix": 0}, "suffix"),
    ({"model": "tiny", "prompt": "x", "suffix": []}, "suffix"),
    ({"model": "tiny", "prompt": "x", "echo": "no"}, "echo"),
    ({"model": "tiny", "prompt": "x", "seed": 2**63}, "seed"),
    ({"model": "tiny", "prompt": "x", "seed": -1}, "seed"),
])
def test_a_field_not_served_is_refused_by_name_in_openais_shape(server, base_url, body,
                                                               param):
    # Sent as ASCII JSON, escapes kept: a lone surrogate is valid JSON but not text.
    reply = httpx.post(f"{base_url}/completions", content=json.dumps(body), timeout=30,
                       headers={"authorization": f"Bearer {server.keys['alice']}",
                                "content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_chat_refusals_and_unknown_models(server, base_url):
    headers = {"authorization": f"Bearer {server.keys['alice']}"}
    cases = [
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "function"}]}, 400, "tools[0]"),
        ({"model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
         "messages[0].content[0]"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}],
          "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ({"model": "tinker://run-000000000000/weights/w", "messages": [
            {"role": "user", "content": "x"}]}, 400, "model"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x", "name": "a"}]},
         400, "messages[0].name"),
        ({"model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]},
         400, "messages[0].content[0].cache_control"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "\udc00"}]}, 400,
         "messages[0].content"),
    ]
    for body, status, param in cases:
        reply = httpx.post(f"{base_url}/chat/completions", content=json.dumps(body),
                           headers={**headers, "content-type": "application/json"},
                           timeout=30)
        assert (reply.status_code, reply.json()["error"]["param"]) == (status, param), \
            reply.text
    # null is "not given", here as for every other field.
    message = [{"role": "user", "content": "x"}]
    for extra in ({"top_logprobs": None},
                  {"max_tokens": None},
                  {"messages": [{"role": "user", "content": "x", "name": None}]}):
        reply = httpx.post(f"{base_url}/chat/completions", headers=headers, timeout=30,
                           json={"model": "tiny", "messages": message,
                                 "max_completion_tokens": 2, **extra})
        assert reply.status_code == 200, reply.text


def test_a_final_assistant_message_is_answered_with_a_turn_of_its_own(server, client):
    """OpenAI's chat continues no message: a trailing assistant turn is closed and the
    reply is a new one (Anthropic's route continues it instead)."""
    from transformers import AutoTokenizer

    from twinkle_server.engine.tiny_model import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "The answer is"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_other_routes_and_methods_answer_in_openais_shape(server, base_url):
    """Once Tinker's shape (404) and plain text (405): an OpenAI client could not read
    them. A model of ';' alone once got the engine's words and no param."""
    headers = {"authorization": f"Bearer {server.keys['alice']}"}
    for method, route, status in [("POST", "embeddings", 404), ("POST", "responses", 404),
                                  ("GET", "completions", 405), ("POST", "models", 405)]:
        reply = httpx.request(method, f"{base_url}/{route}", headers=headers, timeout=30)
        assert reply.status_code == status, reply.text
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    reply = httpx.post(f"{base_url}/completions", headers=headers, timeout=30,
                       json={"model": ";", "prompt": "x"})
    assert (reply.status_code, reply.json()["error"]["param"]) == (400, "model"), reply.text


def test_a_chat_template_that_refuses_the_messages_is_the_requests_error(tiny_cache):
    """A template's `raise_exception` (Gemma's for a system role) names `messages` and
    the template's words; it once answered 500."""
    from transformers import AutoTokenizer

    from twinkle_server.engine.tiny_model import build_tiny_model
    from twinkle_server.http.oai import chat_prompt
    from twinkle_server.http.oai_request import OaiError

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tiny_cache))
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}"
                               "{% endif %}{{ messages[0]['content'] }}")
    assert chat_prompt(tokenizer, [{"role": "user", "content": "hi"}], "tiny").size
    with pytest.raises(OaiError, match="refuses them: System role not supported") as refused:
        chat_prompt(tokenizer, [{"role": "system", "content": "be brief"}], "tiny")
    assert refused.value.param == "messages"


def test_a_disconnected_stream_frees_its_rows(server, base_url):
    """A client that drops a long stream: its rows leave the decode pool."""
    headers = {"authorization": f"Bearer {server.keys['alice']}"}
    metrics = f"http://{server.http_address}/metrics"
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 3000, "n": 2,
            "stream": True, "seed": 1}
    with httpx.stream("POST", f"{base_url}/completions", json=body, headers=headers,
                      timeout=30):
        _rows_until(metrics, lambda rows: rows >= 2, "the stream's rows never started")
    _rows_until(metrics, lambda rows: rows == 0, "the dropped stream's rows still decode")
    # Ended by the disconnect, not by running out of tokens.
    _until(lambda: _gauge(metrics, "twinkle_ops_total", kind="sample",
                          outcome="cancelled") >= 1, "the dropped stream's op never cancelled")


def test_a_request_keeps_no_prefix_its_one_request_session_could_never_reuse(server, client):
    """Each OpenAI request samples in a session of its own; its prompt's KV kept after it
    ends once pushed live sessions' prefixes out of the pool first."""
    metrics = f"http://{server.http_address}/metrics"
    before = _gauge(metrics, "twinkle_prefix_cache_positions")
    client.completions.create(model="tiny", prompt=list(range(20, 420)), max_tokens=2,
                              seed=3)
    assert _gauge(metrics, "twinkle_prefix_cache_positions") == before


def test_a_dropped_connection_frees_its_rows_without_a_stream(server, base_url):
    """A client that gives up on a long completion (no stream): its rows leave the decode
    pool. They once decoded to the end (12 s here) for nobody."""
    import socket

    metrics = f"http://{server.http_address}/metrics"
    before = _gauge(metrics, "twinkle_ops_total", kind="sample", outcome="cancelled")
    body = json.dumps({"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 3000, "n": 2,
                       "seed": 1}).encode()
    host, port = server.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as client:
        client.sendall(b"POST /oai/api/v1/completions HTTP/1.1\r\nHost: x\r\n"
                       b"Authorization: Bearer " + server.keys["alice"].encode() +
                       b"\r\nContent-Type: application/json\r\nContent-Length: " +
                       str(len(body)).encode() + b"\r\n\r\n" + body)
        _rows_until(metrics, lambda rows: rows >= 2, "the request's rows never started")
    _rows_until(metrics, lambda rows: rows == 0, "the dropped request's rows still decode")
    _until(lambda: _gauge(metrics, "twinkle_ops_total", kind="sample",
                          outcome="cancelled") > before, "the dropped request never cancelled")


@pytest.mark.parametrize(("route", "body", "param"), [
    ("completions", {"prompt": [7] * 4095, "max_tokens": 5}, "max_tokens"),
    ("completions", {"prompt": [7] * 4096}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a " * 5000}]},
     "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "a"}],
                          "max_completion_tokens": 5000}, "max_completion_tokens"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_sample_over_the_models_limits_is_refused_before_any_stream(
        server, base_url, route, body, param, stream):
    """The engine's size check, made before the reply starts: a stream once answered 200
    and then an error event."""
    reply = httpx.post(f"{base_url}/{route}", json={"model": "tiny", "stream": stream, **body},
                       headers={"authorization": f"Bearer {server.keys['alice']}"},
                       timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "over this model's limits" in error["message"]


def _rows_until(metrics: str, done, what: str, timeout_s: float = 30) -> None:
    """Wait until `done(rows decoding)` holds, within `timeout_s`; else fail with `what`."""
    _until(lambda: done(_gauge(metrics, "twinkle_decode_rows_active")), what, timeout_s)


def _until(ready, what: str, timeout_s: float = 30) -> None:
    """Wait until `ready()`, within `timeout_s`; else fail with `what`. (The server counts
    an op's outcome when it answers it, a moment after its rows leave the pool.)"""
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _gauge(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(url, timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _audit_events(server, since: int) -> list[tuple[str, str]]:
    with sqlite3.connect(server.data_dir / "twinkle.db") as db:
        return db.execute("SELECT event, details FROM audit_log WHERE entry_id > ? "
                          "ORDER BY entry_id", (since,)).fetchall()


def test_a_request_samples_without_a_session_and_leaves_no_rows_behind(server, client,
                                                                       checkpoint):
    """The route samples through the runtime's sessionless verb: no sampling session, so
    no `sampler_create` / `sampler_end` rows; reading a checkpoint is still audited."""
    path, _ = checkpoint
    with sqlite3.connect(server.data_dir / "twinkle.db") as db:
        since = db.execute("SELECT COALESCE(MAX(entry_id), 0) FROM audit_log").fetchone()[0]
    client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=2, seed=0)
    client.completions.create(model=path, prompt=PROMPT_IDS, max_tokens=2, seed=0)
    time.sleep(1.0)   # the store's writer thread records after the answer
    events = _audit_events(server, since)
    assert [event for event, _ in events] == ["checkpoint_read"], events
    assert json.loads(events[0][1])["purpose"] == "sample"


@pytest.mark.parametrize("prompt", [PROMPT_IDS, "The cat sat on the", [PROMPT_IDS, "Hello"]],
                         ids=["token-ids", "text", "a-list"])
def test_echoed_prompts_carry_a_top_k_dict_with_the_chosen_token_after_the_first(client,
                                                                                  prompt):
    """Harnesses score multiple choice from these dicts (is the continuation greedy?)."""
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True,
                                    logprobs=2, temperature=1.0, seed=4)
    for choice in out.choices:
        logprobs = choice.logprobs
        assert logprobs.top_logprobs[0] is None and logprobs.token_logprobs[0] is None
        for token, top in zip(logprobs.tokens[1:], logprobs.top_logprobs[1:], strict=True):
            assert isinstance(top, dict) and 2 <= len(top) <= 3 and token in top


def test_text_offsets_index_the_choices_text_past_tokens_that_hold_part_of_a_character(
        client):
    """`text_offset` is where each token begins in the choice's text (what harnesses cut
    a continuation from an echoed prompt by): a token holding only part of a character
    (named `bytes:\\xNN`) counts the characters its bytes make, not its name's length.
    Measured: with '中文' split over five tokens, every later offset was 51 characters past
    its token (the names' lengths counted)."""
    out = client.completions.create(model="tiny", prompt="café 中文 ok, naïve", max_tokens=1,
                                    echo=True, logprobs=0, temperature=1.0, seed=4)
    choice = out.choices[0]
    logprobs = choice.logprobs
    assert any(t.startswith("bytes:") for t in logprobs.tokens)   # the case in question
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        if not token.startswith("bytes:"):
            assert choice.text[offset:offset + len(token)] == token, (token, offset,
                                                                      choice.text)
