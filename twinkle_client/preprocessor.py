"""Row preprocessors: `row -> row` callables that build the `messages` a template encodes.

Each keeps the row's fields and adds `messages` (a list of `{'role', 'content'}`); use one
with `Dataset.map(ProcessorClass(...))` or by registered name,
`Dataset.map('SelfCognitionProcessor', init_args={...})`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from twinkle_client.reward import ANSWER_MARKER, final_answer, parse_number

Row = dict[str, Any]

NAME_PLACEHOLDER = "{{NAME}}"
AUTHOR_PLACEHOLDER = "{{AUTHOR}}"
GSM8K_INSTRUCTION = ("Solve the problem step by step, then give the final answer on its "
                     "own line as '#### <number>'.")
# GSM8K's calculator annotations, e.g. `<<48/2=24>>`: noise for a model to learn.
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def _text_field(row: Mapping[str, Any], key: str, processor: str) -> str:
    if not isinstance(row, Mapping):
        raise ValueError(f"{processor}: expected a row dict, got {type(row).__name__}")
    value = row.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{processor}: row field {key!r} must be a string, got "
                         f"{type(value).__name__} (row keys: {sorted(row)})")
    return value


def _system(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


class SelfCognitionProcessor:
    """`query`/`response` with `{{NAME}}`/`{{AUTHOR}}` -> a user/assistant conversation.

    Args:
        model_name: replaces `{{NAME}}` in the query and the response.
        model_author: replaces `{{AUTHOR}}`.
        system: an optional system message put first.
    """

    def __init__(self, model_name: str, model_author: str, system: str | None = None) -> None:
        for field, value in (("model_name", model_name), ("model_author", model_author)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{field}: must be a non-empty string, got {value!r}")
        self.model_name = model_name
        self.model_author = model_author
        self.system = system

    def fill(self, text: str) -> str:
        """`text` with both placeholders replaced."""
        return (text.replace(NAME_PLACEHOLDER, self.model_name)
                .replace(AUTHOR_PLACEHOLDER, self.model_author))

    def __call__(self, row: Mapping[str, Any]) -> Row:
        query = _text_field(row, "query", type(self).__name__)
        response = _text_field(row, "response", type(self).__name__)
        messages = [*_system(self.system),
                    {"role": "user", "content": self.fill(query)},
                    {"role": "assistant", "content": self.fill(response)}]
        return {**row, "messages": messages}


class GSM8KProcessor:
    """GSM8K `question`/`answer` -> messages, plus the reference number as `ground_truth`.

    The user message is the question followed by `instruction` (ask for `#### <number>`);
    the assistant message is the answer without GSM8K's `<<...>>` calculator annotations.
    `ground_truth` is the number after the answer's last `####`, commas removed (`'1234'`),
    which `GSM8KAccuracyReward` compares against.

    Args:
        instruction: appended to each question on a new line.
        system: an optional system message put first.
    """

    def __init__(self, instruction: str = GSM8K_INSTRUCTION, system: str | None = None) -> None:
        self.instruction = instruction
        self.system = system

    def __call__(self, row: Mapping[str, Any]) -> Row:
        name = type(self).__name__
        question = _text_field(row, "question", name)
        answer = _CALCULATOR.sub("", _text_field(row, "answer", name))
        if ANSWER_MARKER not in answer:
            raise ValueError(f"{name}: row field 'answer' has no '{ANSWER_MARKER} <number>' "
                             f"final line: {answer[-80:]!r}")
        number = final_answer(answer)
        if number is None or parse_number(number) is None:
            raise ValueError(f"{name}: row field 'answer' has no number after "
                             f"'{ANSWER_MARKER}': {answer[-80:]!r}")
        user = f"{question}\n{self.instruction}" if self.instruction else question
        messages = [*_system(self.system),
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": answer}]
        return {**row, "messages": messages,
                "ground_truth": number.replace(",", "").replace("$", "")}


PREPROCESSORS: dict[str, type] = {
    "SelfCognitionProcessor": SelfCognitionProcessor,
    "GSM8KProcessor": GSM8KProcessor,
}
"""Preprocessor classes by name, for `Dataset.map(name, init_args=...)`."""


def register_preprocessor(name: str, cls: type) -> None:
    """Make a preprocessor class (instances are `row -> row` callables) usable by name."""
    if not isinstance(cls, type) or not callable(cls):
        raise ValueError(f"cls: expected a class, got {type(cls).__name__}")
    PREPROCESSORS[name] = cls


def get_preprocessor(name: str) -> type:
    """The preprocessor class registered as `name`."""
    if name not in PREPROCESSORS:
        raise ValueError(f"preprocessor: unknown name {name!r}; registered: "
                         f"{sorted(PREPROCESSORS)}")
    return PREPROCESSORS[name]
