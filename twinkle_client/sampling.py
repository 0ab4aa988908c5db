"""Sampling for `MultiLoraTransformersModel.sample`: prompts in, completions out.

`prompts` reads what a user passes as prompts (token ids, features, strings, chat
messages), `params` turns the keyword arguments into the server's sampling parameters,
and `completions` turns the server's samples into `SampledSequence`s with their text and
the training feature an RL loop feeds back (`features.rollout_feature`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from twinkle_client import api
from twinkle_client.features import rollout_feature
from twinkle_client.outputs import SampledSequence, SampleOutput

if TYPE_CHECKING:
    from twinkle_client.template import Template


def prompts(inputs: Any, template: Callable[[], Template]) -> list[np.ndarray]:
    """Prompts as token-id arrays: token ids, a feature with input_ids, a string (one
    user message), a list of chat messages, or a list of any of these (of any lengths,
    kinds mixed); strings and messages are encoded with `template()`."""
    def one(item: Any) -> np.ndarray | None:
        if isinstance(item, str) or (isinstance(item, Sequence) and item
                                     and all(isinstance(m, Mapping) and "role" in m
                                             for m in item)):
            messages = ([{"role": "user", "content": item}] if isinstance(item, str)
                        else list(item))
            return np.asarray(template().encode(
                {"messages": messages}, add_generation_prompt=True)["input_ids"])
        if isinstance(item, Mapping) and "input_ids" in item:
            return np.asarray(item["input_ids"]).reshape(-1)
        if isinstance(item, Mapping) and "messages" in item:
            return np.asarray(template().encode(
                item, add_generation_prompt=True)["input_ids"])
        try:
            array = np.asarray(item)
        except ValueError:  # ragged: a list of prompts (of different lengths or kinds)
            return None
        return array if array.ndim == 1 and array.dtype.kind in "iu" else None

    single = one(inputs)
    if single is not None:
        return [single]
    if isinstance(inputs, Sequence) and inputs:
        found = [one(item) for item in inputs]
        bad = next((i for i, p in enumerate(found) if p is None), None)
        if bad is None:
            return found  # type: ignore[return-value]
        raise ValueError(f"inputs[{bad}]: not a prompt; give token ids, a feature with "
                         "input_ids, a string or a list of chat messages")
    raise ValueError("inputs: not a prompt; give token ids, a feature with input_ids, a "
                     "string, a list of chat messages, or a list of these")


def params(max_tokens: int, temperature: float, top_p: float, top_k: int,
           stop: Sequence[str | int] | None, seed: int | None) -> api.SamplingParams:
    """The sampling keyword arguments as the server's parameters: `stop` entries that are
    strings stop on that text, the others on that token id."""
    stops = list(stop or [])
    return api.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_strings=tuple(s for s in stops if isinstance(s, str)),
        stop_token_ids=tuple(int(s) for s in stops if not isinstance(s, str)), seed=seed)


def completions(prompt_ids: Sequence[np.ndarray], results: Sequence[api.SampleResult],
                decode: Callable[..., str]) -> SampleOutput:
    """Each prompt's samples, prompt by prompt, with their text and RL feature."""
    out = []
    for index, (prompt, result) in enumerate(zip(prompt_ids, results, strict=True)):
        for seq in result.sequences:
            tokens = seq.tokens.astype(np.int64)
            logprobs = seq.logprobs.astype(np.float32)
            out.append(SampledSequence(index, tokens, logprobs, seq.stop_reason,
                                       decode(tokens, skip_special_tokens=True),
                                       rollout_feature(prompt, tokens)))
    return SampleOutput(out)
