"""An OpenAI completions or chat-completions request body, read and checked.

Every field a client may send is either served (read here into `OaiRequest`) or refused
by name (`OaiError`, or a shared reader's `BadBody` from `convert`, with the field as
OpenAI's `param`): a field we do not serve is accepted only at its neutral value
(`frequency_penalty` 0, `logit_bias` empty, ...), which asks for nothing. Nothing here
touches the runtime.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.http import convert
from twinkle_server.http.tool_calls import Tool, ToolUse

MAX_N = 16
"""Most choices per prompt (`n`): each is a row of the decode pool."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives per position (`top_logprobs`, completions' `logprobs`), as the
Tinker routes' top-k."""
MAX_STOPS = 4
"""Most stop sequences, as OpenAI allows."""
MAX_TOOLS = 128
"""Most tools a request may offer, as OpenAI allows."""
TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A tool's name: what both OpenAI and Anthropic accept."""

COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
          "stream_options", "user"}
"""Fields both routes serve."""
SERVED = {
    "completions": COMMON | {"prompt", "logprobs", "echo", "suffix"},
    "chat": COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                      "tools", "tool_choice", "parallel_tool_calls"},
}
NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "best_of": 1,
    "parallel_tool_calls": True, "tool_choice": "none", "tools": [], "functions": [],
    "function_call": "none", "response_format": {"type": "text"}, "service_tier": "auto",
    "store": False, "metadata": {}, "modalities": ["text"], "prediction": None,
    "reasoning_effort": None, "audio": None, "web_search_options": None,
}
"""Fields we do not serve (on completions: the tool fields), with the one value of each
that asks for nothing."""


class OaiError(InvalidArgument):
    """A request refused before it runs, naming its field (OpenAI's `param`)."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


@dataclass(frozen=True)
class OaiRequest:
    """What a request asks for. `prompts` are texts or token-id lists (completions) or
    one list of messages (chat); `top_logprobs` None is no logprobs at all."""

    route: str                      # "completions" or "chat"
    model: str
    prompts: tuple[str | tuple[int, ...], ...] | None
    messages: tuple[dict[str, Any], ...] | None
    max_tokens: int | None          # None: up to the context limit
    max_tokens_field: str           # the field that gave it (or would have)
    temperature: float
    top_p: float
    n: int
    stop: tuple[str, ...]
    seed: int | None
    top_logprobs: int | None
    echo: bool
    stream: bool
    include_usage: bool
    user: str | None
    tools: ToolUse | None = None    # None: the reply is text, whatever it holds
    top_k: int = -1
    continue_final: bool = False    # the last message is the reply's start (a prefill)


def read(route: str, body: Mapping[str, Any]) -> OaiRequest:
    """The request `body` of `route` ('completions' or 'chat'), checked."""
    for key, value in body.items():
        if key in SERVED[route]:
            continue
        if key in NEUTRAL:
            neutral = NEUTRAL[key]
            # true is not 1, nor false 0: the kind must match too (0 and 0.0 do).
            kind = type(value) is type(neutral) or {type(value), type(neutral)} <= {int, float}
            if value is not None and not (kind and value == neutral):
                raise OaiError(key, f"{value!r} is not served here; leave it out")
            continue
        raise OaiError(key, "unknown field; this server serves "
                            f"{sorted(SERVED[route])}")
    model = string_field(body, "model", required=True)
    n = integer(body, "n", 1, 1, MAX_N)
    stream = convert.flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise OaiError("stream_options", "only with stream: true")
    if options is not None and (not isinstance(options, dict)
                                or set(options) - {"include_usage"}):
        raise OaiError("stream_options", "give {\"include_usage\": true|false}")
    include_usage = bool(options and convert.flag(options, "include_usage",
                                                  field="stream_options.include_usage"))
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise OaiError("top_p", "must be > 0")
    seed = convert.seed(body, "seed")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise OaiError("user", "must be a string")
    if user is not None:
        unicode(user, "user")
    common = dict(route=route, model=model, temperature=temperature, top_p=top_p, n=n,
                  stop=_stop(body.get("stop")), seed=seed, stream=stream,
                  include_usage=include_usage, user=user)
    if route == "completions":
        if convert.text(body, "suffix"):
            raise OaiError("suffix", "insertion (a suffix after the completion) is not "
                                     "served; leave it out")
        logprobs = body.get("logprobs")
        top = None if logprobs is None else integer(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
        return OaiRequest(prompts=_prompts(body.get("prompt")), messages=None,
                          max_tokens=max_tokens_of(body, "max_tokens", 16),
                          max_tokens_field="max_tokens", top_logprobs=top,
                          echo=convert.flag(body, "echo"), **common)
    # null is "not given", as for every other field.
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise OaiError("max_completion_tokens", "give it or max_tokens, not both")
    name = ("max_completion_tokens" if body.get("max_completion_tokens") is not None
            else "max_tokens")
    asks_top = body.get("top_logprobs") is not None
    top = integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) if asks_top else 0
    asks_logprobs = convert.flag(body, "logprobs")
    if asks_top and not asks_logprobs:
        raise OaiError("top_logprobs", "needs logprobs: true")
    if body.get("parallel_tool_calls") is False:
        raise OaiError("parallel_tool_calls", "false is not served (a reply may hold "
                                              "several calls); leave it out")
    convert.flag(body, "parallel_tool_calls")
    return OaiRequest(prompts=None, messages=_messages(body.get("messages")),
                      max_tokens=max_tokens_of(body, name, None), max_tokens_field=name,
                      top_logprobs=top if asks_logprobs else None, echo=False,
                      tools=_tool_use(body.get("tools"), body.get("tool_choice")),
                      **common)


def string_field(body: Mapping[str, Any], key: str, required: bool = False) -> str:
    value = body.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or not value:
        raise OaiError(key, "required, a non-empty string" if value is None
                       else f"must be a non-empty string, got {value!r}")
    return value


def unicode(text: str, where: str) -> str:
    """`text`, refused when it is not valid Unicode (a lone surrogate, which JSON's
    `\\ud800` escapes can carry) and so cannot be tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OaiError(where, f"not valid Unicode text ({exc.reason} at position "
                              f"{exc.start})") from None
    return text


def integer(body: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if type(value) is not int or not low <= value <= high:
        raise OaiError(key, f"{value!r}; give an integer in [{low}, {high}]")
    return value


def number(body: Mapping[str, Any], key: str, default: float, low: float,
            high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) \
            or not low <= value <= high:
        raise OaiError(key, f"{value!r}; give a number in [{low:g}, {high:g}]")
    return float(value)


def max_tokens_of(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if type(value) is not int or value < 1:
        raise OaiError(key, f"{value!r}; give an integer >= 1")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise OaiError("stop", "give a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise OaiError("stop", f"{len(stops)} sequences; at most {MAX_STOPS}")
    return tuple(stops)


def _prompts(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, a list of token ids, or a list of either: one prompt each."""
    if isinstance(value, str):
        return (unicode(value, "prompt"),)
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return (_token_ids(value, 0),)
    if isinstance(value, list) and value:
        prompts: list[str | tuple[int, ...]] = []
        for i, item in enumerate(value):
            if isinstance(item, str):
                prompts.append(unicode(item, "prompt"))
            elif isinstance(item, list) and item and all(type(t) is int for t in item):
                prompts.append(_token_ids(item, i))
            else:
                raise OaiError("prompt", f"item {i}: give a string or a list of token ids")
        return tuple(prompts)
    raise OaiError("prompt", "required: a string, a list of token ids, or a list of either")


def _token_ids(ids: list[int], item: int) -> tuple[int, ...]:
    """Token ids a 64-bit integer holds; the model's vocabulary is checked once it is
    known."""
    if any(not 0 <= t < 2**63 for t in ids):
        raise OaiError("prompt", f"item {item}: token ids must be in [0, vocabulary size)")
    return tuple(ids)


ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_FIELDS = {"role", "content", "tool_calls", "tool_call_id"}


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    """Chat messages with text content (a string, or a list of text parts); an
    assistant's may carry `tool_calls` instead, and a `tool` message answers one."""
    if not isinstance(value, list) or not value:
        raise OaiError("messages", "required: a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise OaiError(where, "must be an object with role and content")
        extra = sorted(k for k in set(message) - MESSAGE_FIELDS
                       if message[k] is not None)    # null: left out
        if extra:
            raise OaiError(f"{where}.{extra[0]}", "not served here (text messages and "
                                                  "tool calls only)")
        role = message.get("role")
        if role not in ROLES:
            raise OaiError(f"{where}.role", f"{role!r}; give one of {list(ROLES)}")
        calls = message.get("tool_calls")
        if calls is not None and role != "assistant":
            raise OaiError(f"{where}.tool_calls", "only an assistant message makes calls")
        if (message.get("tool_call_id") is not None) != (role == "tool"):
            raise OaiError(f"{where}.tool_call_id", "a tool message answers one call: "
                                                    "give its id, and only there")
        read: dict[str, Any] = {"role": "system" if role == "developer" else role}
        if calls:
            read["content"] = "" if message.get("content") is None \
                else _content(message["content"], f"{where}.content")
            read["tool_calls"] = _calls(calls, f"{where}.tool_calls")
        else:
            read["content"] = _content(message.get("content"), f"{where}.content")
        if role == "tool":
            call_id = message["tool_call_id"]
            if not isinstance(call_id, str) or not call_id:
                raise OaiError(f"{where}.tool_call_id", "must be a non-empty string")
            read["tool_call_id"] = call_id
        out.append(read)
    return tuple(out)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return unicode(value, where)
    if isinstance(value, list) and value:
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise OaiError(f"{where}[{j}]", "only text parts are served "
                                                "({\"type\": \"text\", \"text\": ...})")
            if extra := sorted(k for k in set(part) - {"type", "text"}
                               if part[k] is not None):
                raise OaiError(f"{where}[{j}].{extra[0]}", "not served here; a text part "
                                                           "is its type and text only")
            texts.append(unicode(part["text"], f"{where}[{j}].text"))
        return "".join(texts)
    raise OaiError(where, "give a string or a list of text parts")


def _calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls, their arguments as objects (as templates take them)."""
    if not isinstance(value, list):
        raise OaiError(where, "give a list of calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise OaiError(at, "give {\"id\", \"type\": \"function\", \"function\": "
                               "{\"name\", \"arguments\"}}")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise OaiError(f"{at}.function.name", f"{name!r}; give a tool's name")
        arguments = function.get("arguments")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise OaiError(f"{at}.function.arguments", "give a JSON object, as a string")
        calls.append(call_message(str(call.get("id") or ""), name, parsed))
    return calls


def call_message(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A call as an assistant message carries it to a chat template."""
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def read_tool(name: Any, description: Any, parameters: Any, where: str,
              schema_field: str) -> Tool:
    """One tool's parts, checked; `where` names it in an error (`tools[3].function`),
    `schema_field` its arguments' schema (`parameters`, Anthropic's `input_schema`)."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise OaiError(f"{where}.name", f"{name!r}; give 1 to 64 letters, digits, "
                                        "'_', '.' or '-'")
    if description is not None and not isinstance(description, str):
        raise OaiError(f"{where}.description", "must be a string")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise OaiError(f"{where}.{schema_field}", "must be a JSON schema object")
    if parameters.get("type", "object") != "object":
        raise OaiError(f"{where}.{schema_field}.type",
                       f"{parameters['type']!r}; a tool's arguments are an object")
    if not isinstance(parameters.get("properties", {}), dict):
        raise OaiError(f"{where}.{schema_field}.properties", "must be an object")
    return Tool(unicode(name, f"{where}.name"), description or "", parameters)


def check_tools(tools: list[Tool], field: str) -> tuple[Tool, ...]:
    """At most `MAX_TOOLS`, each name once."""
    if len(tools) > MAX_TOOLS:
        raise OaiError(field, f"{len(tools)} tools; at most {MAX_TOOLS}")
    names = [tool.name for tool in tools]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise OaiError(field, f"two tools are named {twice[0]!r}")
    return tuple(tools)


def _tool_use(tools: Any, choice: Any) -> ToolUse | None:
    """OpenAI's `tools` and `tool_choice`: None where the reply is text ("none", or no
    tools)."""
    if tools is not None and not isinstance(tools, list):
        raise OaiError("tools", "give a list of {\"type\": \"function\", \"function\": "
                                "{...}}")
    read = []
    for i, tool in enumerate(tools or ()):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise OaiError(f"tools[{i}]", "give {\"type\": \"function\", \"function\": "
                                          "{\"name\", \"description\", \"parameters\"}}")
        if extra := sorted(set(function) - {"name", "description", "parameters", "strict"}):
            raise OaiError(f"tools[{i}].function.{extra[0]}", "not served here")
        if function.get("strict"):
            raise OaiError(f"tools[{i}].function.strict", "schema-constrained decoding is "
                                                          "not served; leave it out")
        read.append(read_tool(function.get("name"), function.get("description"),
                              function.get("parameters"), f"tools[{i}].function",
                              "parameters"))
    offered = check_tools(read, "tools")
    if choice in (None, "auto"):
        return ToolUse(offered) if offered else None
    if choice == "none":
        return None
    if not offered:
        raise OaiError("tool_choice", f"{choice!r} needs tools")
    if choice == "required":
        return ToolUse(offered, "required")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) \
        and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
        else None
    if name is None:
        raise OaiError("tool_choice", "give \"none\", \"auto\", \"required\" or "
                                      "{\"type\": \"function\", \"function\": {\"name\"}}")
    if name not in {tool.name for tool in offered}:
        raise OaiError("tool_choice", f"names {name!r}, which is not among the tools")
    return ToolUse(offered, "named", name)
