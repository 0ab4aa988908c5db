"""Template: shifted labels masked exactly on prompt positions, truncation, prompts, errors.

The expected labels come from an independent computation: the ChatML text of the tiny
model is written out by hand, one segment per header/turn, each segment tokenized on its
own, and a target carries loss exactly when it belongs to an assistant segment.
"""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from twinkle_client.features import IGNORE_INDEX, feature_to_loss_inputs
from twinkle_client.template import Template, TemplateError, build_template

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
SINGLE = [SYSTEM,
          {"role": "user", "content": "Who are you?"},
          {"role": "assistant", "content": "I am Twinkle, made by ModelScope."}]
MULTI = [{"role": "user", "content": "你好，你是谁？"},
         {"role": "assistant", "content": "我是Twinkle。"},
         {"role": "user", "content": "What is 2 + 3?"},
         {"role": "assistant", "content": "2 + 3 = 5\n#### 5"}]


@pytest.fixture(scope="session")
def model_dir(tiny_cache):
    from twinkle_server.engine.tiny_model import build_tiny_model

    return str(build_tiny_model(tiny_cache))


@pytest.fixture(scope="session")
def template(model_dir) -> Template:
    return Template(model_dir)


def chatml_reference(tokenizer, messages, loss_turns=None):
    """Tokens and per-token loss flags of the ChatML conversation, built by hand."""
    assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    loss_turns = assistant if loss_turns is None else loss_turns
    tokens, flags = [], []
    for k, message in enumerate(messages):
        for text, is_loss in ((f"<|im_start|>{message['role']}\n", False),
                              (f"{message['content']}<|im_end|>\n", k in loss_turns)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            tokens += ids
            flags += [is_loss] * len(ids)
    return np.asarray(tokens), np.asarray(flags)


def expected_feature(tokenizer, messages, loss_turns=None):
    tokens, flags = chatml_reference(tokenizer, messages, loss_turns)
    return tokens[:-1], np.where(flags[1:], tokens[1:], IGNORE_INDEX)


def test_single_turn_labels_are_ignored_exactly_where_the_next_token_is_prompt(template):
    feature = template.encode({"messages": SINGLE})
    ids, labels = expected_feature(template.tokenizer, SINGLE)
    np.testing.assert_array_equal(feature["input_ids"], ids)
    np.testing.assert_array_equal(feature["labels"], labels)
    assert feature["input_ids"].dtype == np.int64 and feature["labels"].dtype == np.int64


def test_every_assistant_turn_of_a_multi_turn_conversation_carries_loss(template):
    feature = template.encode({"messages": MULTI})
    ids, labels = expected_feature(template.tokenizer, MULTI)
    np.testing.assert_array_equal(feature["input_ids"], ids)
    np.testing.assert_array_equal(feature["labels"], labels)
    runs = np.split(feature["labels"], np.flatnonzero(np.diff(feature["labels"] == IGNORE_INDEX)) + 1)
    learned = [template.decode(run) for run in runs if run[0] != IGNORE_INDEX]
    assert learned == ["我是Twinkle。<|im_end|>\n", "2 + 3 = 5\n#### 5<|im_end|>\n"]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALLING = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"type": "function", "function": {"name": "get_weather",
                                                 "arguments": {"city": "Paris"}}}]},
           {"role": "tool", "content": "sunny"},
           {"role": "assistant", "content": "It is sunny."}]


def test_a_rows_tools_reach_the_chat_template_and_its_calls_are_learned(template):
    """A row's `tools` are rendered as the template writes them (its tool block), in the
    training text and the generation prompt alike; the assistant's calls carry loss.
    Once `tools` was dropped without a word: the model learned calls to tools it was
    never shown."""
    row = {"messages": CALLING, "tools": TOOLS}
    feature = template.encode(row)
    full = template.tokenizer.apply_chat_template(CALLING, tools=TOOLS, tokenize=False)
    text = template.decode(np.append(feature["input_ids"], feature["labels"][-1]))
    assert text == full and '"name": "get_weather"' in text.split("<|im_end|>")[0]
    runs = np.split(feature["labels"], np.flatnonzero(np.diff(feature["labels"] == IGNORE_INDEX)) + 1)
    learned = [template.decode(run) for run in runs if run[0] != IGNORE_INDEX]
    assert learned[0].startswith("<tool_call>\n{\"name\": \"get_weather\"")
    assert learned[1] == "It is sunny.<|im_end|>\n"
    prompt = template.encode({"messages": CALLING[:1], "tools": TOOLS},
                             add_generation_prompt=True)
    assert template.decode(prompt["input_ids"]) == template.tokenizer.apply_chat_template(
        CALLING[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    with pytest.raises(TemplateError, match=r"row 2: 'tools' must be a list of dicts"):
        template.encode({"messages": CALLING, "tools": "get_weather"}, index=2)


def test_last_turn_only_puts_loss_on_the_final_assistant_message_only(model_dir):
    template = Template(model_dir, last_turn_only=True)
    feature = template.encode({"messages": MULTI})
    _, labels = expected_feature(template.tokenizer, MULTI, loss_turns=[3])
    np.testing.assert_array_equal(feature["labels"], labels)


def test_labels_are_the_input_shifted_by_one_and_the_last_token_is_dropped(template):
    feature = template.encode({"messages": SINGLE})
    full = template.tokenizer(template.render(SINGLE), add_special_tokens=False)["input_ids"]
    np.testing.assert_array_equal(feature["input_ids"], full[:-1])
    kept = feature["labels"] != IGNORE_INDEX
    np.testing.assert_array_equal(feature["labels"][kept], np.asarray(full[1:])[kept])
    assert template.decode(feature["labels"][kept]) == "I am Twinkle, made by ModelScope.<|im_end|>\n"


def test_encoded_feature_is_what_the_wire_codec_consumes(template):
    feature = template.encode({"messages": SINGLE})
    ids, inputs = feature_to_loss_inputs(feature)
    kept = feature["labels"] != IGNORE_INDEX
    assert inputs["weights"].sum() == kept.sum() > 0
    np.testing.assert_array_equal(inputs["target_tokens"][kept], feature["labels"][kept])


def test_reply_token_merged_with_the_header_space_still_carries_loss(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}<|endoftext|>{% else %}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    template = Template(tokenizer=tokenizer)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "I am here"}]
    labels = template.encode({"messages": messages})["labels"]
    learned = template.decode(labels[labels != IGNORE_INDEX])
    assert learned.endswith("I am here<|endoftext|>") and "Hi" not in learned


def test_template_that_renders_turns_differently_later_is_refused_by_name(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if loop.last %}LAST {% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match=r"row 4: .*prefix"):
        Template(tokenizer=tokenizer).encode({"messages": MULTI}, index=4)


@pytest.mark.parametrize("max_length", [30, 34])
def test_right_truncation_keeps_the_start_and_the_shift(template, max_length):
    full_ids, full_labels = expected_feature(template.tokenizer, SINGLE)
    tokens = np.append(full_ids, full_labels[-1])
    feature = Template(tokenizer=template.tokenizer, max_length=max_length).encode(
        {"messages": SINGLE})
    np.testing.assert_array_equal(feature["input_ids"], tokens[:max_length])
    np.testing.assert_array_equal(feature["labels"], full_labels[:max_length])


def test_a_row_cut_to_no_assistant_token_is_refused_naming_it(template):
    """Right truncation that keeps only the prompt leaves a row that trains nothing:
    once it was returned without a word, its labels all ignored."""
    _, full_labels = expected_feature(template.tokenizer, SINGLE)
    first = int(np.flatnonzero(full_labels != IGNORE_INDEX)[0])
    cut = Template(tokenizer=template.tokenizer, max_length=first)
    with pytest.raises(TemplateError, match=rf"row 3: cut to max_length {first} on the right, "
                                            "it keeps none of its assistant tokens"):
        cut.encode({"messages": SINGLE}, index=3)
    kept = Template(tokenizer=template.tokenizer, max_length=first + 1).encode(
        {"messages": SINGLE})
    assert (kept["labels"] != IGNORE_INDEX).sum() == 1


def test_left_truncation_keeps_the_end_and_the_shift(template):
    full_ids, full_labels = expected_feature(template.tokenizer, SINGLE)
    feature = Template(tokenizer=template.tokenizer, max_length=6,
                       truncation_strategy="left").encode({"messages": SINGLE})
    np.testing.assert_array_equal(feature["input_ids"], full_ids[-6:])
    np.testing.assert_array_equal(feature["labels"], full_labels[-6:])


def test_raise_truncation_names_the_row_its_length_and_the_limit(template):
    length = len(expected_feature(template.tokenizer, SINGLE)[0])
    strict = Template(tokenizer=template.tokenizer, max_length=8, truncation_strategy="raise")
    with pytest.raises(TemplateError, match=rf"row 7: {length} tokens .* max_length 8"):
        strict.encode({"messages": SINGLE}, index=7)
    assert len(Template(tokenizer=template.tokenizer, max_length=length,
                        truncation_strategy="raise").encode({"messages": SINGLE})["input_ids"]) \
        == length


def test_generation_prompt_drops_the_reference_answer_and_ends_with_the_assistant_header(template):
    feature = template.encode({"messages": SINGLE}, add_generation_prompt=True)
    assert set(feature) == {"input_ids"}
    text = template.decode(feature["input_ids"])
    assert text.endswith("Who are you?<|im_end|>\n<|im_start|>assistant\n")
    assert "Twinkle" not in text
    expected = template.tokenizer(template.render(SINGLE[:2], add_generation_prompt=True),
                                  add_special_tokens=False)["input_ids"]
    np.testing.assert_array_equal(feature["input_ids"], expected)


def test_generation_prompt_over_the_limit_is_cut_on_the_left_or_refused(template):
    full = template.encode({"messages": SINGLE[:2]}, add_generation_prompt=True)["input_ids"]
    left = Template(tokenizer=template.tokenizer, max_length=6, truncation_strategy="left")
    np.testing.assert_array_equal(
        left.encode({"messages": SINGLE[:2]}, add_generation_prompt=True)["input_ids"], full[-6:])
    right = Template(tokenizer=template.tokenizer, max_length=6)
    with pytest.raises(TemplateError, match=r"row 0: the generation prompt .* max_length 6"):
        right.encode({"messages": SINGLE[:2]}, add_generation_prompt=True)


def test_batch_encoding_equals_row_by_row_encoding(template):
    rows = [{"messages": SINGLE}, {"messages": MULTI}]
    batch = template.encode_batch(rows)
    for row, feature in zip(rows, batch, strict=True):
        single = template.encode(row)
        np.testing.assert_array_equal(feature["input_ids"], single["input_ids"])
        np.testing.assert_array_equal(feature["labels"], single["labels"])


@pytest.mark.parametrize("row, message", [
    ({"query": "hi"}, r"row 3: has no 'messages'.*preprocessor"),
    ({"messages": []}, r"row 3: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": 5}]}, r"row 3: messages\[0\]\.content must be a string"),
    ({"messages": [{"role": "user", "content": "hi"}]}, r"row 3: .*no assistant message.*add_generation_prompt"),
    ("text", r"row 3: expected a dict"),
])
def test_bad_rows_get_an_error_naming_the_row_and_field(template, row, message):
    with pytest.raises(TemplateError, match=message):
        template.encode(row, index=3)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_length": 0}, "max_length: must be a positive int"),
    ({"truncation_strategy": "middle"}, "truncation_strategy: 'middle' is not one of"),
])
def test_bad_settings_are_refused_at_construction(template, kwargs, message):
    with pytest.raises(TemplateError, match=message):
        Template(tokenizer=template.tokenizer, **kwargs)


def test_a_tokenizer_without_chat_template_is_refused(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = None
    with pytest.raises(TemplateError, match="has no chat template"):
        Template(tokenizer=tokenizer)


def test_templates_are_built_by_name_class_or_instance(model_dir, template):
    assert build_template("Template", model_id=model_dir, max_length=9).max_length == 9
    assert build_template(Template, tokenizer=template.tokenizer).tokenizer is template.tokenizer
    assert build_template(template) is template
    with pytest.raises(TemplateError, match=r"unknown template 'Nope'; registered: \['Template'"):
        build_template("Nope")


def test_decode_round_trips_the_rendered_text(template):
    text = template.render(MULTI)
    ids = template.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert template.decode(ids) == text
