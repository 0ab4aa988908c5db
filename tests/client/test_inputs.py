"""What users hand the native client: prompts of different lengths and kinds to `sample`,
and conversations that open with an assistant message to the template."""

from __future__ import annotations

import numpy as np
import pytest
from peft import LoraConfig

from twinkle_client.features import IGNORE_INDEX
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.template import Template


@pytest.fixture(scope="module")
def template(tiny_cache) -> Template:
    from twinkle_server.engine.tiny_model import build_tiny_model

    return Template(str(build_tiny_model(tiny_cache)))


def learned(template: Template, messages: list[dict[str, str]]) -> list[str]:
    """The text of each run of labels that carries loss."""
    labels = template.encode({"messages": messages})["labels"]
    runs = np.split(labels, np.flatnonzero(np.diff(labels == IGNORE_INDEX)) + 1)
    return [template.decode(run) for run in runs if run[0] != IGNORE_INDEX]


# ----------------------------------------------------------------------------- template


def test_a_conversation_opening_with_an_assistant_message_trains_on_that_message(template):
    assert learned(template, [{"role": "assistant", "content": "Hello, how can I help?"}]) == [
        "Hello, how can I help?<|im_end|>\n"]
    assert learned(template, [{"role": "assistant", "content": "Hi!"},
                              {"role": "user", "content": "2 + 3?"},
                              {"role": "assistant", "content": "5"}]) == [
        "Hi!<|im_end|>\n", "5<|im_end|>\n"]


def test_an_opening_assistant_message_keeps_its_header_as_prompt(template):
    feature = template.encode({"messages": [{"role": "assistant", "content": "A0"}]})
    header = template.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    # labels[t] is the target of input t: the header's tokens are never targets.
    assert (feature["labels"][:len(header) - 1] == IGNORE_INDEX).all()
    assert template.decode(feature["input_ids"][:len(header)]) == "<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- sampling


@pytest.mark.integration
def test_sample_gives_one_set_of_completions_per_prompt_of_any_length_or_kind(client):
    model = MultiLoraTransformersModel("ms://tiny")
    model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear"))
    ragged = model.sample([[5, 6, 7], [8, 9]], max_tokens=2, num_samples=2)
    assert [s.prompt_index for s in ragged.sequences] == [0, 0, 1, 1]
    for seq, prompt in zip(ragged.sequences, ([5, 6, 7], [5, 6, 7], [8, 9], [8, 9]),
                           strict=True):
        assert seq.new_input_feature["input_ids"][:len(prompt)].tolist() == prompt

    mixed = model.sample(["hello", [5, 6, 7]], max_tokens=2)
    assert [s.prompt_index for s in mixed.sequences] == [0, 1]
    hello = Template("tiny").encode({"messages": [{"role": "user", "content": "hello"}]},
                                    add_generation_prompt=True)["input_ids"].tolist()
    for seq, prompt in zip(mixed.sequences, (hello, [5, 6, 7]), strict=True):
        assert seq.new_input_feature["input_ids"][:len(prompt)].tolist() == prompt
