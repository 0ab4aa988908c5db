"""Tool calls on the OpenAI chat route, driven by the real `openai` package: the tiny model,
trained by the stock SDK to call a tool (`tool_caller`), is an agent through the route.
Its tools are rendered by its own chat template (Qwen3's format) and its calls read back
into `tool_calls`, whole and streamed."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from twinkle_server.http.oai_request import MAX_TOOLS

from .conftest import (
    ANSWER,
    ASK,
    HARMONY_ANSWER,
    HARMONY_CALL,
    RESULT,
    WEATHER,
    harmony_model,
    keyed_server,
    tool_caller,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory, tiny_cache) -> Path:
    return harmony_model(tmp_path_factory.mktemp("models"), tiny_cache)


@pytest.fixture(scope="module")
def server(tmp_path_factory, harmony_dir):
    models = harmony_dir.parent / "models.toml"
    models.write_text(f'[[models]]\nname = "tiny"\npath = "tiny"\n\n'
                      f'[[models]]\nname = "harmony"\npath = "{harmony_dir}"\n')
    proc = keyed_server(tmp_path_factory.mktemp("oai-tools"), "--decode-slice-ms", "1",
                        "--models", str(models))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_address}/oai/api/v1",
                         api_key=server.keys["alice"], max_retries=0)


@pytest.fixture(scope="module")
def agent(server) -> str:
    return tool_caller(server)


def test_a_tool_call_round_trip_parses_the_call_and_renders_the_result_back(client, agent):
    first = client.chat.completions.create(model=agent, messages=ASK, tools=[WEATHER],
                                           temperature=0.0, max_tokens=48)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call, = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    final = client.chat.completions.create(
        model=agent, tools=[WEATHER], temperature=0.0, max_tokens=48,
        messages=[*ASK, choice.message,
                  {"role": "tool", "tool_call_id": call.id, "content": RESULT}])
    assert final.choices[0].message.content == ANSWER
    assert final.choices[0].finish_reason == "stop"
    assert not final.choices[0].message.tool_calls


def test_a_streamed_tool_call_arrives_as_tool_call_deltas_equal_to_the_whole(client, agent):
    asked = dict(model=agent, messages=ASK, tools=[WEATHER], temperature=0.0,
                 max_tokens=48)
    whole = client.chat.completions.create(**asked).choices[0].message.tool_calls[0]
    chunks = list(client.chat.completions.create(**asked, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    calls = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert texts == []                # the call's text is never streamed as content
    call, = calls
    assert (call.index, call.function.name) == (0, whole.function.name)
    assert json.loads(call.function.arguments) == json.loads(whole.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_harmony_model_calls_on_its_commentary_channel_and_answers_on_final(
        server, client, harmony_dir):
    agent = tool_caller(server, base="harmony", tokenizer_dir=harmony_dir,
                        replies=(HARMONY_CALL, HARMONY_ANSWER))
    first = client.chat.completions.create(model=agent, messages=ASK, tools=[WEATHER],
                                           temperature=0.0, max_tokens=48).choices[0]
    assert first.finish_reason == "tool_calls"
    call, = first.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    final = client.chat.completions.create(
        model=agent, tools=[WEATHER], temperature=0.0, max_tokens=48,
        messages=[*ASK, first.message,
                  {"role": "tool", "tool_call_id": call.id, "content": RESULT}])
    # The analysis channel (its reasoning) is not shown; the final channel is.
    assert final.choices[0].message.content == ANSWER
    assert final.choices[0].finish_reason == "stop"


def test_tool_choice_none_answers_text_and_a_named_choice_starts_that_call(client, agent):
    plain = client.chat.completions.create(model=agent, messages=ASK, tools=[WEATHER],
                                           tool_choice="none", temperature=0.0,
                                           max_tokens=48).choices[0]
    assert not plain.message.tool_calls and plain.finish_reason != "tool_calls"
    named = client.chat.completions.create(
        model=agent, messages=ASK, tools=[WEATHER], temperature=0.0, max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert named.finish_reason == "tool_calls"
    assert named.message.tool_calls[0].function.name == "get_weather"


def test_a_required_call_the_base_cannot_write_stays_text_and_is_not_an_error(client):
    # The untrained base draws noise after the forced `<tool_call>` opening: not a call.
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                           tool_choice="required", temperature=0.0,
                                           max_tokens=8).choices[0]
    assert not reply.message.tool_calls and reply.finish_reason in ("length", "stop")
    assert reply.message.content.startswith("<tool_call>")


def test_tools_a_request_cannot_offer_are_refused_by_name(server):
    headers = {"authorization": f"Bearer {server.keys['alice']}"}
    url = f"http://{server.http_address}/oai/api/v1/chat/completions"
    many = [{"type": "function", "function": {"name": f"f{i}"}}
            for i in range(MAX_TOOLS + 1)]
    cases = [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "string"}}}]},
         "tools[0].function.parameters.type"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": many}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                              "function": {"name": "other"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tools": [{"type": "function", "function": {**WEATHER["function"],
                                                      "strict": True}}]},
         "tools[0].function.strict"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]},
         "messages[1].tool_call_id"),
    ]
    for extra, param in cases:
        body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
        reply = httpx.post(url, json=body, headers=headers, timeout=30)
        assert reply.status_code == 400, (param, reply.text)
        assert reply.json()["error"]["param"] == param, reply.text
    # A tool list too long for the model's context is the prompt's size, refused by name.
    huge = [{"type": "function", "function": {"name": f"f{i}", "description": "x " * 400}}
            for i in range(MAX_TOOLS)]
    reply = httpx.post(url, json={"model": "tiny", "messages": ASK, "tools": huge},
                       headers=headers, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages"
    # Nothing was held: the next good request is served.
    reply = httpx.post(url, json={"model": "tiny", "messages": ASK, "tools": [WEATHER],
                                  "max_tokens": 2}, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
