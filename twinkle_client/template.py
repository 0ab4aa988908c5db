"""Chat templates: a row with `messages` -> the token feature the training calls take.

An encoded training feature is Tinker's convention (`features.feature_to_loss_inputs`
reads exactly this): for the conversation's tokens `T[0..n)`,

- `input_ids = T[:-1]` (int64 numpy array),
- `labels[t] = T[t+1]` when `T[t+1]` is an assistant token, else `IGNORE_INDEX` (-100),

so `labels` is shifted and as long as `input_ids`. Assistant tokens are each assistant
message's content plus what the chat template writes after it in that turn (the closing
`<|im_end|>` and newline for ChatML); the assistant header and every other message are
prompt. Spans are found by rendering the conversation prefix by prefix
(`apply_chat_template(messages[:k])`), never by searching tokens, and mapped to tokens by
the tokenizer's character offsets, so the tokens are exactly those of the whole rendered
text; a token carries loss when any of its characters is an assistant character. A
conversation may start with an assistant message (a greeting): it carries loss like any
assistant turn, its header (and any default system prompt the template adds) being what
the template writes before its content.

A generation prompt (`add_generation_prompt=True`) is the rendered conversation up to and
including the assistant header, as `input_ids` only: what a sampler continues.

transformers is imported only by the tokenizer loader, never at module import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from twinkle_client.features import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from twinkle_client.connection import Connection

TruncationStrategy = Literal["right", "left", "raise"]
TRUNCATION_STRATEGIES: tuple[str, ...] = ("right", "left", "raise")
Feature = dict[str, Any]


class TemplateError(ValueError):
    """A row or setting the template cannot encode; the message names the row and field."""


class Template:
    """The model's own chat template (from its tokenizer), with loss on assistant turns.

    Args:
        model_id: a local model directory, or the name of a model the connected Twinkle
            server serves (`ms://`/`hf://` prefixes allowed); its tokenizer is loaded with
            `twinkle_client.tokenizer.load_tokenizer`. May be None when `tokenizer` is given.
        max_length: the most tokens in an encoded `input_ids` (what the server counts);
            None = no limit.
        truncation_strategy: what to do with a longer row: `'right'` keeps its start,
            `'left'` keeps its end, `'raise'` raises `TemplateError`. A generation prompt
            is never cut on the right (that would cut its assistant header): over the limit
            it is cut on the left under `'left'` and is an error otherwise.
        last_turn_only: put loss on the last assistant message only (default: every
            assistant message carries loss).
        chat_template_kwargs: extra variables for the chat template, e.g.
            `{'enable_thinking': False}` for Qwen3 templates.
        tokenizer: a tokenizer to use instead of loading one for `model_id`.
        connection: the server connection for a served model (default: the one
            `init_twinkle_client` made).

    Raises:
        TemplateError: a bad setting, or a tokenizer with no chat template or no
            character offsets (a slow tokenizer).

    Example:
        >>> template = Template('/models/tiny', max_length=512)
        >>> feature = template.encode({'messages': [{'role': 'user', 'content': 'Hi'},
        ...                                         {'role': 'assistant', 'content': 'Hello!'}]})
        >>> sorted(feature)
        ['input_ids', 'labels']
    """

    def __init__(self, model_id: str | None = None, max_length: int | None = None,
                 truncation_strategy: TruncationStrategy = "right", *,
                 last_turn_only: bool = False,
                 chat_template_kwargs: Mapping[str, Any] | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 connection: Connection | None = None) -> None:
        if max_length is not None and (isinstance(max_length, bool)
                                       or not isinstance(max_length, int) or max_length < 1):
            raise TemplateError(f"max_length: must be a positive int or None, got {max_length!r}")
        if truncation_strategy not in TRUNCATION_STRATEGIES:
            raise TemplateError(f"truncation_strategy: {truncation_strategy!r} is not one of "
                                f"{list(TRUNCATION_STRATEGIES)}")
        if tokenizer is None:
            if not model_id:
                raise TemplateError("model_id: pass a model directory or served model name "
                                    "(or a tokenizer)")
            from twinkle_client.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model_id, connection)
        source = f"the tokenizer of {model_id!r}" if model_id else "the given tokenizer"
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(f"model_id: {source} has no chat template")
        if not getattr(tokenizer, "is_fast", False):
            raise TemplateError(f"model_id: {source} is a slow tokenizer; masking needs a fast "
                                "one (with a tokenizer.json)")
        self.model_id = model_id
        self.max_length = max_length
        self.truncation_strategy = truncation_strategy
        self.last_turn_only = last_turn_only
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.tokenizer = tokenizer

    def encode(self, row: Mapping[str, Any], add_generation_prompt: bool = False,
               index: int = 0) -> Feature:
        """One row -> `{'input_ids', 'labels'}` (or `{'input_ids'}` for a generation prompt).

        Args:
            row: a mapping with `messages`, a list of `{'role', 'content'}` strings, and
                optionally `tools` (OpenAI's function schema), rendered by the template.
            add_generation_prompt: encode a prompt for sampling: the conversation without a
                trailing assistant message (a reference answer), then the assistant header.
            index: the row's position, used in error messages.

        Raises:
            TemplateError: bad messages, no assistant message to learn from, or a row over
                `max_length` that the truncation strategy does not allow.
        """
        return self.encode_batch([row], add_generation_prompt, start_index=index)[0]

    def encode_batch(self, rows: Sequence[Mapping[str, Any]],
                     add_generation_prompt: bool = False, start_index: int = 0
                     ) -> list[Feature]:
        """Rows -> features, tokenized in one tokenizer call (fast for many rows).

        `start_index` is the position of `rows[0]`, so errors name the dataset row.
        """
        if not rows:
            return []
        texts: list[str] = []
        spans: list[list[tuple[int, int]]] = []
        for offset, row in enumerate(rows):
            messages = _messages(row, start_index + offset)
            tools = _tools(row, start_index + offset)
            if add_generation_prompt:
                if len(messages) > 1 and messages[-1]["role"] == "assistant":
                    messages = messages[:-1]
                texts.append(self.render(messages, add_generation_prompt=True, tools=tools))
                spans.append([])
            else:
                text, row_spans = self._assistant_spans(messages, start_index + offset, tools)
                texts.append(text)
                spans.append(row_spans)
        encoded = self.tokenizer(texts, add_special_tokens=False,
                                 return_offsets_mapping=not add_generation_prompt)
        features = []
        for offset, ids in enumerate(encoded["input_ids"]):
            tokens = np.asarray(ids, dtype=np.int64)
            index = start_index + offset
            if add_generation_prompt:
                features.append({"input_ids": self._truncate_prompt(tokens, index)})
                continue
            chars = np.asarray(encoded["offset_mapping"][offset], dtype=np.int64).reshape(-1, 2)
            loss = np.zeros(tokens.shape[0], dtype=bool)
            for begin, end in spans[offset]:
                # Overlap, not containment: a token that merges the header's trailing space
                # with the reply's first word (' I') still teaches the reply.
                loss |= (chars[:, 0] < end) & (chars[:, 1] > begin)
            features.append(self._shift(tokens, loss, index))
        return features

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Token ids -> text (special tokens kept unless `skip_special_tokens`)."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]],
               add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The chat template's text for `messages` (and the `tools` offered to the model,
        as the template writes them), without tokenizing."""
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tools=[dict(t) for t in tools] if tools else None,
            tokenize=False, add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs)

    def _assistant_spans(self, messages: list[dict[str, Any]], index: int,
                         tools: list[dict[str, Any]] | None = None
                         ) -> tuple[str, list[tuple[int, int]]]:
        """The full text and the character spans of the assistant turns that carry loss.

        The span of assistant message k runs from the end of `render(messages[:k])` with the
        generation prompt (its header) to the end of `render(messages[:k + 1])`; both must be
        prefixes of the full text, which holds for templates that render each turn
        independently of the later ones (ChatML, Llama, Mistral, ...).
        """
        full = self.render(messages, tools=tools)
        assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        if not assistant:
            raise TemplateError(f"row {index}: messages has no assistant message to learn "
                                "from; encode it with add_generation_prompt=True to make a "
                                "prompt for sampling")
        if self.last_turn_only:
            assistant = assistant[-1:]
        spans = []
        for k in assistant:
            head = (self.render(messages[:k], add_generation_prompt=True, tools=tools) if k
                    else self._leading_header(messages[0], tools))
            turn = full if k == len(messages) - 1 else self.render(messages[:k + 1],
                                                                   tools=tools)
            for prefix, what in ((head, f"messages[:{k}] with the generation prompt" if k
                                  else "the header of messages[0]"),
                                 (turn, f"messages[:{k + 1}]")):
                if not full.startswith(prefix):
                    raise TemplateError(
                        f"row {index}: the chat template renders {what} differently from the "
                        "start of the whole conversation, so assistant turns cannot be found "
                        "by prefix; use last_turn_only=True or a prefix-stable template")
            spans.append((len(head), len(turn)))
        return full, spans

    def _leading_header(self, message: dict[str, Any],
                        tools: list[dict[str, Any]] | None) -> str:
        """What the template writes before the content of a conversation's first message,
        an assistant one (there is no earlier prefix to render with the generation prompt):
        the common start of that message rendered with two different contents."""
        return os.path.commonprefix([self.render([{**message, "content": probe}], tools=tools)
                                     for probe in ("a", "b")])

    def _shift(self, tokens: np.ndarray, loss: np.ndarray, index: int) -> Feature:
        """Truncate to `max_length` + 1 tokens, then `input_ids = T[:-1]`, `labels = T[1:]`;
        a cut that leaves no assistant token to learn from is refused."""
        if tokens.shape[0] < 2:
            raise TemplateError(f"row {index}: renders to {tokens.shape[0]} token(s); a training "
                                "row needs at least 2")
        length = tokens.shape[0] - 1
        if self.max_length is not None and length > self.max_length:
            keep = self.max_length + 1
            if self.truncation_strategy == "raise":
                raise TemplateError(
                    f"row {index}: {length} tokens (input_ids after the shift) exceed "
                    f"max_length {self.max_length}; raise max_length or use "
                    "truncation_strategy 'right' or 'left'")
            right = self.truncation_strategy == "right"
            window = slice(None, keep) if right else slice(-keep, None)
            if loss.any() and not loss[window][1:].any():
                raise TemplateError(
                    f"row {index}: cut to max_length {self.max_length} on the "
                    f"{'right' if right else 'left'}, it keeps none of its assistant tokens "
                    "and would train nothing; raise max_length, use truncation_strategy "
                    f"{'left' if right else 'right'!r}, or leave the row out")
            tokens, loss = tokens[window], loss[window]
        labels = np.where(loss[1:], tokens[1:], IGNORE_INDEX).astype(np.int64)
        return {"input_ids": tokens[:-1].copy(), "labels": labels}

    def _truncate_prompt(self, tokens: np.ndarray, index: int) -> np.ndarray:
        """A generation prompt within `max_length`: cut on the left only, never the header."""
        if self.max_length is None or tokens.shape[0] <= self.max_length:
            return tokens
        if self.truncation_strategy == "left":
            return tokens[-self.max_length:].copy()
        raise TemplateError(
            f"row {index}: the generation prompt has {tokens.shape[0]} tokens, over max_length "
            f"{self.max_length}; a prompt cannot be cut on the right (it would lose the "
            "assistant header): raise max_length or use truncation_strategy='left'")


def _messages(row: Any, index: int) -> list[dict[str, Any]]:
    """`row['messages']` checked: a non-empty list of `{'role': str, 'content': str}`
    (an assistant turn that only calls tools has content ''); other keys of a message,
    such as `tool_calls`, go to the chat template as they are."""
    if not isinstance(row, Mapping):
        raise TemplateError(f"row {index}: expected a dict, got {type(row).__name__}")
    messages = row.get("messages")
    if messages is None:
        raise TemplateError(f"row {index}: has no 'messages' (keys: {sorted(row)}); map a "
                            "preprocessor such as SelfCognitionProcessor over the dataset first")
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) \
            or not messages:
        raise TemplateError(f"row {index}: 'messages' must be a non-empty list of "
                            f"{{'role', 'content'}} dicts, got {messages!r:.80}")
    checked = []
    for k, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TemplateError(f"row {index}: messages[{k}] must be a dict, "
                                f"got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise TemplateError(f"row {index}: messages[{k}].{key} must be a string, "
                                    f"got {type(message.get(key)).__name__}")
        checked.append(dict(message))
    return checked


def _tools(row: Mapping[str, Any], index: int) -> list[dict[str, Any]] | None:
    """`row['tools']` checked: None (absent), or a list of tool dicts (OpenAI's function
    schema, as chat templates take them)."""
    tools = row.get("tools")
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence) \
            or not all(isinstance(t, Mapping) for t in tools):
        raise TemplateError(f"row {index}: 'tools' must be a list of dicts (OpenAI's "
                            f"function schema), got {tools!r:.80}")
    return [dict(t) for t in tools]


TEMPLATES: dict[str, type[Template]] = {"Template": Template}
"""Template classes by name, for `Dataset.set_template('Template', ...)`."""


def register_template(name: str, cls: type[Template]) -> None:
    """Make `cls` (a `Template` subclass) available under `name`."""
    if not (isinstance(cls, type) and issubclass(cls, Template)):
        raise TemplateError(f"cls: {cls!r} is not a Template subclass")
    TEMPLATES[name] = cls


def build_template(template: str | type[Template] | Template, **kwargs: Any) -> Template:
    """A Template from a registered name, a Template class (with `kwargs`), or an instance."""
    if isinstance(template, Template):
        if kwargs:
            raise TemplateError(f"template: an instance takes no arguments, got {sorted(kwargs)}")
        return template
    if isinstance(template, str):
        if template not in TEMPLATES:
            raise TemplateError(f"template: unknown template {template!r}; registered: "
                                f"{sorted(TEMPLATES)}")
        template = TEMPLATES[template]
    if not (isinstance(template, type) and issubclass(template, Template)):
        raise TemplateError(f"template: expected a template name, Template class or instance, "
                            f"got {type(template).__name__}")
    return template(**kwargs)
