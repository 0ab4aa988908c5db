"""Rewards for GRPO on GSM8K-style answers (`... #### <number>`).

Every reward has one signature, `reward(completions, ground_truths=None) -> list[float]`:

- `completions`: the sampled texts as strings, or trajectories as dicts. A dict gives its
  text as `completion` (a string) or as the content of the last `assistant` message in
  `messages`, and its ground truth as `ground_truth` (what `GSM8KProcessor` stores).
- `ground_truths`: one reference answer per completion; needed for plain strings by the
  rewards that compare against it, optional with dicts (overrides `ground_truth`).

Example:
    >>> GSM8KAccuracyReward()(['2 + 3 = 5\\n#### 5', 'I think 6'], ['5', '5'])
    [1.0, 0.0]
    >>> GSM8KFormatReward()(['#### 5', 'The answer is 5'])
    [1.0, 0.0]
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

ANSWER_MARKER = "####"
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_FORMAT = re.compile(r"####\s*" + _NUMBER.pattern)


def parse_number(text: str) -> Decimal | None:
    """`text` as a number, ignoring `$` and thousands commas (`'$1,234.50'`); None if not one."""
    cleaned = text.strip().replace(",", "").replace("$", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def final_answer(text: str) -> str | None:
    """The answer a completion gives: the first number after its last `####`, or failing
    that, the last number anywhere in it; None if it has no number."""
    if ANSWER_MARKER in text:
        match = _NUMBER.search(text.rsplit(ANSWER_MARKER, 1)[1])
        if match:
            return match.group()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _completion_text(item: Any, index: int) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, Mapping):
        if isinstance(item.get("completion"), str):
            return item["completion"]
        for message in reversed(item.get("messages") or []):
            if isinstance(message, Mapping) and message.get("role") == "assistant":
                return str(message.get("content", ""))
        raise ValueError(f"completions[{index}]: a dict needs a 'completion' string or "
                         "an assistant message in 'messages'")
    raise ValueError(f"completions[{index}]: expected a string or a dict, "
                     f"got {type(item).__name__}")


def _ground_truths(completions: Sequence[Any], ground_truths: Sequence[Any] | None
                   ) -> list[Decimal]:
    if ground_truths is not None:
        if len(ground_truths) != len(completions):
            raise ValueError(f"ground_truths: {len(ground_truths)} values for "
                             f"{len(completions)} completions; give one per completion")
        raw = list(ground_truths)
    else:
        raw = []
        for index, item in enumerate(completions):
            if not isinstance(item, Mapping) or item.get("ground_truth") is None:
                raise ValueError(f"ground_truths: missing for completions[{index}]; pass "
                                 "ground_truths or dicts with a 'ground_truth'")
            raw.append(item["ground_truth"])
    parsed = []
    for index, value in enumerate(raw):
        number = parse_number(str(value))
        if number is None:
            raise ValueError(f"ground_truths[{index}]: {value!r} is not a number")
        parsed.append(number)
    return parsed


class GSM8KAccuracyReward:
    """1.0 when the completion's final answer (see `final_answer`) equals the ground truth
    as a number (`'18.0'` matches `'18'`), else 0.0."""

    def __call__(self, completions: Sequence[str | Mapping[str, Any]],
                 ground_truths: Sequence[str | float] | None = None) -> list[float]:
        truths = _ground_truths(completions, ground_truths)
        rewards = []
        for index, (item, truth) in enumerate(zip(completions, truths, strict=True)):
            answer = final_answer(_completion_text(item, index))
            value = parse_number(answer) if answer is not None else None
            rewards.append(1.0 if value is not None and value == truth else 0.0)
        return rewards


class GSM8KFormatReward:
    """1.0 when the completion contains `#### <number>`, else 0.0. `ground_truths` is not
    used; it is accepted so every reward is called the same way."""

    def __call__(self, completions: Sequence[str | Mapping[str, Any]],
                 ground_truths: Sequence[str | float] | None = None) -> list[float]:
        if ground_truths is not None and len(ground_truths) != len(completions):
            raise ValueError(f"ground_truths: {len(ground_truths)} values for "
                             f"{len(completions)} completions; give one per completion")
        return [1.0 if _FORMAT.search(_completion_text(item, index)) else 0.0
                for index, item in enumerate(completions)]
