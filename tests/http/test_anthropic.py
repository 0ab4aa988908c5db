"""Anthropic's Messages route (`/anthropic/api/v1`), driven by the real `anthropic` package
against a real server process whose decode slices are 1 ms long (a stream of many
tokens goes out in many events): text, streams, tool use on the tiny model trained to
call a tool (`tool_caller`), `count_tokens`, and errors in Anthropic's shape."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from transformers import AutoTokenizer

from twinkle_server.engine.tiny_model import build_tiny_model

from .conftest import ANSWER, ASK, RESULT, WEATHER, keyed_server, tool_caller

pytestmark = pytest.mark.integration

TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}
"""`WEATHER` in Anthropic's shape."""
HELLO = [{"role": "user", "content": "The cat sat on the"}]
GREEDY = {"temperature": 0.0}
"""Served, but no longer a parameter of the `anthropic` package's `messages.create`
(2.x): sent as an extra body field."""


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    proc = keyed_server(tmp_path_factory.mktemp("anthropic"), "--decode-slice-ms", "1")
    yield proc
    proc.stop()


def client_of(server, tenant: str = "alice", **options) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://{server.http_address}/anthropic/api",
                               api_key=server.keys[tenant], max_retries=0, **options)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return client_of(server)


@pytest.fixture(scope="module")
def agent(server) -> str:
    return tool_caller(server)


def test_a_message_answers_text_with_its_stop_reason_and_usage(client):
    reply = client.messages.create(model="tiny", messages=HELLO, max_tokens=12,
                                   extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.id
    assert [block.type for block in reply.content] in (["text"], [])
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= reply.usage.output_tokens <= 12
    counted = client.messages.count_tokens(model="tiny", messages=HELLO)
    assert reply.usage.input_tokens == counted.input_tokens


def test_count_tokens_is_the_prompt_as_the_chat_template_renders_it(client):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False,
                                         add_generation_prompt=True)
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=ASK,
                                           tools=[TOOL])
    assert counted.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))


def test_a_long_stream_arrives_in_many_deltas_that_join_to_the_whole_reply(client):
    asked = dict(model="tiny", messages=HELLO, max_tokens=32, extra_body=GREEDY)
    whole = client.messages.create(**asked)
    kinds, texts = [], []
    with client.messages.stream(**asked) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                texts.append(event.delta.text)
        final = stream.get_final_message()
    assert whole.usage.output_tokens >= 16      # long enough to span many slices
    assert len(texts) > 1
    assert "".join(texts) == whole.content[0].text == final.content[0].text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_delta") < kinds.index("message_delta")
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_reply_and_is_named(client):
    free = client.messages.create(model="tiny", messages=HELLO, max_tokens=32,
                                  extra_body=GREEDY).content[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    reply = client.messages.create(model="tiny", messages=HELLO, max_tokens=32,
                                   extra_body=GREEDY, stop_sequences=[stop])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert stop not in reply.content[0].text and free.startswith(reply.content[0].text)


def test_a_tool_use_round_trip_with_the_result_rendered_back(client, agent):
    first = client.messages.create(model=agent, messages=ASK, tools=[TOOL],
                                   max_tokens=48, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    use, = first.content
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    final = client.messages.create(
        model=agent, tools=[TOOL], max_tokens=48, extra_body=GREEDY,
        messages=[*ASK, {"role": "assistant", "content": first.content},
                  {"role": "user", "content": [{"type": "tool_result",
                                                "tool_use_id": use.id,
                                                "content": RESULT}]}])
    assert final.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in final.content] == [("text", ANSWER)]


def test_a_streamed_tool_use_is_a_tool_use_block_with_its_input(client, agent):
    with client.messages.stream(model=agent, messages=ASK, tools=[TOOL], max_tokens=48,
                                extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    use, = final.content
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use" and "text" not in kinds
    forced = client.messages.create(model=agent, messages=ASK, tools=[TOOL], max_tokens=48,
                                    extra_body=GREEDY,
                                    tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.type for b in forced.content] == ["tool_use"]


def _count(tokenizer, messages: list[dict], **options) -> int:
    """Tokens of `messages` as the tiny model's chat template renders them."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_a_failed_tool_result_reaches_the_model_marked_as_an_error(client):
    """Claude Code sends `is_error: true` for a tool that failed: the template shows the
    tool message's content, so the marker is put there."""
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    call = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "t1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    for is_error, shown in ((True, "Error: boom"), (False, "boom")):
        counted = client.messages.count_tokens(model="tiny", tools=[TOOL], messages=[
            *ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                     "name": "get_weather",
                                                     "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": "boom", "is_error": is_error}]}])
        expected = _count(tokenizer, [*ASK, call, {"role": "tool", "tool_call_id": "t1",
                                                   "content": shown}],
                          tools=[WEATHER], add_generation_prompt=True)
        assert counted.input_tokens == expected, is_error


def test_a_final_assistant_message_is_continued_as_a_prefill(server, client):
    """Anthropic's prefill: the last assistant message is left open and the reply is what
    follows it, the same greedy tokens as a plain completion of the open rendering."""
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    prefill = [*HELLO, {"role": "assistant", "content": "The answer is"}]
    continued = tokenizer.apply_chat_template(prefill, tokenize=False,
                                              continue_final_message=True)
    assert continued.endswith("The answer is")
    ids = tokenizer.encode(continued, add_special_tokens=False)
    assert client.messages.count_tokens(model="tiny", messages=prefill).input_tokens \
        == len(ids)
    reply = client.messages.create(model="tiny", messages=prefill, max_tokens=6,
                                   extra_body=GREEDY)
    plain = httpx.post(f"http://{server.http_address}/oai/api/v1/completions", timeout=60,
                       headers={"authorization": f"Bearer {server.keys['alice']}"},
                       json={"model": "tiny", "prompt": ids, "max_tokens": 6,
                             "temperature": 0.0}).json()["choices"][0]["text"]
    assert reply.usage.input_tokens == len(ids)
    assert "".join(b.text for b in reply.content) == plain
    # An empty final assistant message starts nothing: a new turn opens, as without it.
    empty = [*HELLO, {"role": "assistant", "content": ""}]
    assert client.messages.count_tokens(model="tiny", messages=empty).input_tokens \
        == _count(tokenizer, HELLO, add_generation_prompt=True)


def test_errors_come_in_anthropics_shape_and_name_the_field(server, client, agent):
    with pytest.raises(anthropic.NotFoundError, match="gpt"):
        client.messages.create(model="gpt-4o", messages=HELLO, max_tokens=4)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=f"http://{server.http_address}/anthropic/api",
                            api_key="sk-not-a-key", max_retries=0).messages.create(
            model="tiny", messages=HELLO, max_tokens=4)
    with pytest.raises(anthropic.NotFoundError):       # alice's checkpoint, to bob
        client_of(server, "bob").messages.create(model=agent, messages=HELLO, max_tokens=4)
    url = f"http://{server.http_address}/anthropic/api/v1/messages"
    headers = {"x-api-key": server.keys["alice"], "anthropic-version": "2023-06-01"}
    cases = [
        ({"max_tokens": None}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]},
         "messages[0].content[0].cache_control"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64"}}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages[0].content[0].type"),
        ({"tools": [{"name": "get_weather"}]}, "tools[0].input_schema"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "tools[0].type"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}},
         "tool_choice.name"),
        ({"tools": [TOOL], "tool_choice": {"type": "auto",
                                           "disable_parallel_tool_use": True}},
         "tool_choice.disable_parallel_tool_use"),
        ({"stop_sequences": ["a"] * 17}, "stop_sequences"),
        # A value of the wrong kind is refused, not read as left out.
        ({"stop_sequences": 0}, "stop_sequences"),
        ({"stop_sequences": ""}, "stop_sequences"),
        ({"stop_sequences": False}, "stop_sequences"),
        ({"stop_sequences": {}}, "stop_sequences"),
        ({"stop_sequences": "abc"}, "stop_sequences"),
        ({"messages": [*HELLO, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]}],
          "tools": [TOOL]}, "messages"),
        ({"messages": [*HELLO, {"role": "assistant", "content": "It"}], "tools": [TOOL],
          "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"top_k": 0}, "top_k"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
    ]
    for extra, field in cases:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 4, **extra}
        reply = httpx.post(url, json={k: v for k, v in body.items() if v is not None},
                           headers=headers, timeout=30)
        assert reply.status_code == 400, (field, reply.text)
        error = reply.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith(field + ":"), (field, reply.text)
        if extra.get("tool_choice") == {"type": "any"}:   # in the caller's words
            assert "'any' forces a call" in error["error"]["message"], reply.text
    other = httpx.get(f"http://{server.http_address}/anthropic/api/v1/models",
                      headers=headers, timeout=30)
    assert other.status_code == 404 and other.json()["error"]["type"] == "not_found_error"
    bearer = httpx.post(url, json={"model": "tiny", "messages": HELLO, "max_tokens": 2},
                        headers={"authorization": f"Bearer {server.keys['alice']}"},
                        timeout=30)
    assert bearer.status_code == 200 and bearer.json()["type"] == "message"
    # Nothing was held: the next good request is served.
    assert client.messages.create(model="tiny", messages=HELLO,
                                  max_tokens=2).usage.output_tokens >= 1
