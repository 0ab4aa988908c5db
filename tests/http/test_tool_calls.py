"""Tool formats: which a chat template writes, what forces a call, where a stream holds
back, and replies read back into calls (or left as text) in each served format."""

from __future__ import annotations

import pytest

from twinkle_server.engine.tiny_model import CHAT_TEMPLATE
from twinkle_server.http.tool_calls import (
    Harmony,
    Hermes,
    Llama3Json,
    QwenXml,
    Tool,
    ToolCall,
    ToolUse,
    format_of,
)

WEATHER = Tool("get_weather", "", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}})
TOOLS = (WEATHER,)


def test_each_familys_template_is_read_as_its_format_and_others_are_refused_by_reason():
    assert isinstance(format_of(CHAT_TEMPLATE), Hermes)
    qwen35 = "{% if tools %}<tools>{{ tools }}</tools><tool_call>\n<function=x>\n" \
             "<parameter=y>\n{% endif %}"
    assert isinstance(format_of(qwen35), QwenXml)
    llama = "<|start_header_id|>{% if tools %}\"parameters\": dictionary{% endif %}"
    assert isinstance(format_of(llama), Llama3Json)
    assert isinstance(format_of("{% if tools %}<|channel|>x<|message|>{% endif %}"), Harmony)
    assert "defines no tools" in format_of("{{ messages }}")
    assert "defines no tools" in format_of(None)


def test_hermes_calls_are_read_with_the_text_around_them():
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", ' \
           '"arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>'
    parsed = Hermes().parse(text, TOOLS)
    assert parsed.content == "Let me look."
    assert parsed.calls == (ToolCall("get_weather", {"city": "Paris"}),
                            ToolCall("get_weather", {"city": "Rome"}))
    # A call cut off after its JSON (no closing tag) is still a call.
    assert Hermes().parse('<tool_call>\n{"name": "get_weather", "arguments": {}}',
                          TOOLS).calls == (ToolCall("get_weather", {}),)


@pytest.mark.parametrize("text", [
    "just text",
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call><tool_call>{',
])
def test_a_reply_that_is_not_wholly_well_formed_calls_to_offered_tools_stays_text(text):
    assert Hermes().parse(text, TOOLS) is None


def test_qwen_xml_calls_take_json_values_except_where_the_schema_says_string():
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n" \
           "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    parsed = QwenXml().parse(text, TOOLS)
    assert parsed.calls == (ToolCall("get_weather", {"city": "42", "days": 3}),)
    assert parsed.content is None
    assert QwenXml().parse("<tool_call>\n<function=nope>\n</function>\n</tool_call>",
                           TOOLS) is None


def test_a_llama3_call_is_the_whole_reply_as_one_json_object():
    parsed = Llama3Json().parse(' {"name": "get_weather", "parameters": {"city": "Oslo"}}',
                                TOOLS)
    assert parsed.calls == (ToolCall("get_weather", {"city": "Oslo"}),)
    assert Llama3Json().parse('The answer is {"name": "get_weather"}', TOOLS) is None


def test_a_stream_holds_back_from_where_a_call_may_begin():
    hermes = Hermes()
    assert hermes.call_start("Sure, ") is None
    assert hermes.call_start("Sure, <tool") == 6            # may be the opener's start
    assert hermes.call_start("Sure, <tool_call>\n{") == 6
    llama = Llama3Json()
    assert llama.call_start("  {\"na") == 2 and llama.call_start("  ") == 2
    assert llama.call_start("Hello") is None


def test_a_required_or_named_choice_forces_the_opening_of_a_call():
    named = ToolUse(TOOLS, "named", "get_weather")
    assert Hermes().forced(named) == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert Hermes().forced(ToolUse(TOOLS, "required")) == "<tool_call>\n"
    assert Hermes().forced(ToolUse(TOOLS)) == ""
    assert QwenXml().forced(named) == "<tool_call>\n<function=get_weather>\n"
    assert Llama3Json().forced(named) == '{"name": "get_weather", "parameters": '
    # What a forced reply draws after the opening reads back as the call.
    forced = Hermes().forced(named) + '{"city": "Paris"}}\n</tool_call>'
    assert Hermes().parse(forced, TOOLS).calls == (ToolCall("get_weather",
                                                            {"city": "Paris"}),)


def test_a_harmony_reply_shows_its_final_channel_and_calls_from_messages_to_functions():
    reply = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
             "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
             '{"city": "Oslo"}<|call|>')
    parsed = Harmony().parse(reply, TOOLS)
    assert parsed.calls == (ToolCall("get_weather", {"city": "Oslo"}),)
    assert parsed.content is None              # the analysis channel is not shown
    # The recipient may come before the channel too, as gpt-oss writes it.
    before = ' to=functions.get_weather<|channel|>commentary <|constrain|>json' \
             '<|message|>{"days": 2}<|call|>'
    assert Harmony().parse(before, TOOLS).calls == (ToolCall("get_weather", {"days": 2}),)
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final" \
             "<|message|>Sunny.<|return|>"
    assert Harmony().parse(answer, TOOLS) is None and Harmony().text(answer) == "Sunny."
    assert Harmony().text("no channels at all") is None
    bad = "<|channel|>commentary to=functions.get_weather<|message|>{oops<|call|>"
    assert Harmony().parse(bad, TOOLS) is None
    assert Harmony().forced(ToolUse(TOOLS, "named", "get_weather")) == \
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
