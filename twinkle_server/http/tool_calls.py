"""Tool calls on the chat routes: the tools a request offers, the tool format of a model's
chat template, and the model's reply parsed back into calls.

A model learns one way to see tools and to write a call, and its chat template says which.
Tools are rendered by the template itself (`apply_chat_template(..., tools=...)`); the
call is read back from the reply's text in that template's format:

- `hermes` (Qwen3, Qwen2.5, the built-in `tiny`): a JSON object a call,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- `qwen_xml` (Qwen3.5 / Qwen3.6, Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n`
  `<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`, each value JSON
  where its schema is not a string;
- `llama3_json` (Llama 3.1 and later): the whole reply one JSON object,
  `{"name": ..., "parameters": {...}}`;
- `harmony` (gpt-oss): the reply is messages on channels, read with their special
  tokens: a call is a message to `functions.NAME` (`<|channel|>commentary
  to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`), the text shown is the
  `final` channel's (the `analysis` channel is the model's reasoning, not shown). A
  Harmony model's replies are read so with or without tools.

A template that writes calls another way or defines no tools is refused by name when a
request offers tools. A reply that does not parse as calls to offered tools stays text.

`tool_choice` "required" or a named function is served by starting the reply with the
format's opening of a call (that function's, when named): the model writes the rest.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON
    schema (an object)."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def for_template(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's function shape)."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """The tools a request offers and how the reply must use them: `choice` "auto" (the
    model decides), "required" (some call) or "named" (a call to `name`)."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Parsed:
    """A reply read in a tool format: its text outside the calls (stripped; None when
    empty) and its calls, in order."""

    content: str | None
    calls: tuple[ToolCall, ...]


class ToolFormat:
    """How one family's template writes a call: the text that forces one, where a call
    may begin in a reply being streamed, and the reply read back."""

    opener = ""
    special_tokens = False
    """True: replies are read with their special tokens, and shown as `text` says."""

    def text(self, raw: str) -> str | None:
        """What a reply read with its special tokens shows as text (None: the reply as
        decoded without them)."""
        return None

    required_opening = ""
    """The start of any call: what `tool_choice` "required" begins the reply with."""

    def named_opening(self, name: str) -> str:
        """The start of a call to `name`: what a named `tool_choice` begins it with."""
        raise NotImplementedError

    def forced(self, use: ToolUse) -> str:
        """The start of the reply that `use.choice` requires ("" for auto)."""
        if use.choice == "named":
            return self.named_opening(use.name or "")
        return self.required_opening if use.choice == "required" else ""

    def call_start(self, text: str) -> int | None:
        """Where in `text` (a reply so far) a call may begin: a stream holds back the
        text from there until the reply is whole. None: no call can begin in it."""
        at = text.find(self.opener)
        if at >= 0:
            return at
        for k in range(len(self.opener) - 1, 0, -1):
            if text.endswith(self.opener[:k]):
                return len(text) - k
        return None

    def parse(self, text: str, tools: Sequence[Tool]) -> Parsed | None:
        """`text`'s calls, or None where it holds none or any that is not a well-formed
        call to one of `tools`."""
        raise NotImplementedError


def _outside(text: str, spans: Sequence[tuple[int, int]]) -> str | None:
    parts, at = [], 0
    for start, end in spans:
        parts.append(text[at:start])
        at = end
    parts.append(text[at:])
    return "".join(parts).strip() or None


class Hermes(ToolFormat):
    opener = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    required_opening = "<tool_call>\n"

    def named_opening(self, name: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '

    def parse(self, text: str, tools: Sequence[Tool]) -> Parsed | None:
        names = {tool.name for tool in tools}
        calls, spans = [], []
        for match in self._BLOCK.finditer(text):
            try:
                call = json.loads(match.group(1))
            except ValueError:
                return None
            if not isinstance(call, dict) or call.get("name") not in names:
                return None
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):   # some models write the arguments as a string
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return None
            if not isinstance(arguments, dict):
                return None
            calls.append(ToolCall(call["name"], arguments))
            spans.append(match.span())
        return Parsed(_outside(text, spans), tuple(calls)) if calls else None


class QwenXml(ToolFormat):
    opener = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*"
                        r"(?:</tool_call>|\Z)", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    required_opening = "<tool_call>\n<function="

    def named_opening(self, name: str) -> str:
        return f"<tool_call>\n<function={name}>\n"

    def parse(self, text: str, tools: Sequence[Tool]) -> Parsed | None:
        by_name = {tool.name: tool for tool in tools}
        calls, spans, at = [], [], 0
        for match in self._BLOCK.finditer(text):
            tool = by_name.get(match.group(1).strip())
            if tool is None or text[at:match.start()].count(self.opener):
                return None          # an unknown function, or a block that did not parse
            properties = tool.parameters.get("properties") or {}
            arguments = {}
            for name, value in self._PARAM.findall(match.group(2)):
                kind = (properties.get(name) or {}).get("type")
                arguments[name] = value if kind == "string" else _json_or_text(value)
            calls.append(ToolCall(tool.name, arguments))
            spans.append(match.span())
            at = match.end()
        if not calls or text[at:].count(self.opener):
            return None
        return Parsed(_outside(text, spans), tuple(calls))


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


class Llama3Json(ToolFormat):
    opener = "{"

    required_opening = '{"name": "'

    def named_opening(self, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": '

    def call_start(self, text: str) -> int | None:
        # A call is the whole reply: held from its first character while it may be one.
        body = text.lstrip()
        return len(text) - len(body) if not body or body.startswith("{") else None

    def parse(self, text: str, tools: Sequence[Tool]) -> Parsed | None:
        try:
            call = json.loads(text)
        except ValueError:
            return None
        names = {tool.name for tool in tools}
        if not isinstance(call, dict) or call.get("name") not in names:
            return None
        arguments = call.get("parameters", call.get("arguments", {}))
        if not isinstance(arguments, dict):
            return None
        return Parsed(None, (ToolCall(call["name"], arguments),))


class Harmony(ToolFormat):
    special_tokens = True
    _MESSAGE = re.compile(r"(.*?)<\|message\|>(.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|\Z)",
                          re.DOTALL)
    _RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")

    required_opening = "<|channel|>commentary to=functions."

    def named_opening(self, name: str) -> str:
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"

    def call_start(self, text: str) -> int | None:
        return 0      # a reply's channels are known once it is whole

    def _messages(self, raw: str) -> list[tuple[str, str]]:
        """(header, body) of each message of a reply (the generation prompt opened the
        first: `<|start|>assistant`)."""
        return [self._MESSAGE.match(part).groups()    # type: ignore[union-attr]
                for part in raw.split("<|start|>") if "<|message|>" in part]

    def text(self, raw: str) -> str | None:
        finals = [body for header, body in self._messages(raw)
                  if "<|channel|>final" in header]
        return "".join(finals) if finals else None

    def parse(self, text: str, tools: Sequence[Tool]) -> Parsed | None:
        names = {tool.name for tool in tools}
        calls, finals = [], []
        for header, body in self._messages(text):
            recipient = self._RECIPIENT.search(header)
            if recipient is None:
                if "<|channel|>final" in header:
                    finals.append(body)
                continue
            try:
                arguments = json.loads(body)
            except ValueError:
                return None
            if recipient.group(1) not in names or not isinstance(arguments, dict):
                return None
            calls.append(ToolCall(recipient.group(1), arguments))
        return Parsed("".join(finals).strip() or None, tuple(calls)) if calls else None


def format_of(template: str | None) -> ToolFormat | str:
    """The tool format a chat template writes calls in, or why none is served (the
    reason, as text)."""
    if template and "<|channel|>" in template and "<|message|>" in template:
        return Harmony()
    if not template or "tools" not in template:
        return "its chat template defines no tools"
    if "<function=" in template and "<parameter=" in template:
        return QwenXml()
    if "<tool_call>" in template:
        return Hermes()
    if "<|start_header_id|>" in template and "parameters" in template:
        return Llama3Json()
    return "its chat template writes calls in a format this server does not parse"
