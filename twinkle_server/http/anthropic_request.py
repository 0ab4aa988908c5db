"""An Anthropic Messages request body (`/v1/messages`, `/v1/messages/count_tokens`),
read and checked into the chat request the OpenAI route serves (`OaiRequest`).

Every field is served or refused by name (`OaiError`, which the route answers in
Anthropic's error shape): `thinking` only disabled, `service_tier` only "auto" or
"standard_only", a block's `cache_control` not at all (a sessionless request reuses no
prefix). Messages alternate as Anthropic's do; a user turn's `tool_result` blocks become
the template's `tool` messages, an assistant's `tool_use` blocks its calls.

A `tool_result` with `is_error: true` (what an agent such as Claude Code sends when a
tool failed) is served: its text reaches the template as the tool message's content
behind `TOOL_ERROR_PREFIX`, the one part of a tool message every chat template shows, so
the model reads that the call failed and why. A final assistant message is continued, as
Anthropic's prefill is: the template renders it open (`continue_final_message`), the
reply's text is only what follows it; an empty one is no prefill (a new turn opens),
and one holding `tool_use` blocks, or a prefill beside a `tool_choice` that forces a
call, is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle_server.http import convert
from twinkle_server.http.oai_request import (
    OaiError,
    OaiRequest,
    call_message,
    check_tools,
    integer,
    max_tokens_of,
    number,
    read_tool,
    string_field,
    unicode,
)
from twinkle_server.http.tool_calls import ToolUse

MAX_STOP_SEQUENCES = 16
"""Most `stop_sequences` a request may give: each is searched for in every drawn token's
text."""
SERVED = {"model", "max_tokens", "messages", "system", "temperature", "top_p", "top_k",
          "stop_sequences", "stream", "tools", "tool_choice", "metadata", "thinking",
          "service_tier"}
COUNTED = {"model", "messages", "system", "tools", "tool_choice", "thinking"}
"""What `count_tokens` reads: the prompt's parts."""
TOOL_ERROR_PREFIX = "Error: "
"""Put before the text of a `tool_result` whose `is_error` is true."""


def read(body: Mapping[str, Any], counting: bool = False) -> OaiRequest:
    """A Messages request `body` (`counting`: a count_tokens body), checked."""
    allowed = COUNTED if counting else SERVED
    for key in body:
        if key not in allowed:
            raise OaiError(key, "unknown field; this route serves " + str(sorted(allowed)))
    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        raise OaiError("thinking", "extended thinking is not served; leave it out")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise OaiError("service_tier", f"{body['service_tier']!r}; give \"auto\" or "
                                       "\"standard_only\"")
    model = string_field(body, "model", required=True)
    messages, prefill = _prefill(_messages(body.get("messages"), body.get("system")))
    tools = _tool_use(body.get("tools"), body.get("tool_choice"))
    if prefill and tools is not None and tools.choice != "auto":
        asked = body["tool_choice"].get("type")   # "any" or "tool": the caller's words
        raise OaiError("tool_choice", f"{asked!r} forces a call, which cannot "
                                      "follow a final assistant message (a prefill); "
                                      "leave one of them out")
    if counting:
        return OaiRequest(route="chat", model=model, prompts=None, messages=messages,
                          max_tokens=None, max_tokens_field="max_tokens", temperature=1.0,
                          top_p=1.0, n=1, stop=(), seed=None, top_logprobs=None,
                          echo=False, stream=False, include_usage=False, user=None,
                          tools=tools, continue_final=prefill)
    if body.get("max_tokens") is None:
        raise OaiError("max_tokens", "required, an integer >= 1")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict)
                                 or set(metadata) - {"user_id"}):
        raise OaiError("metadata", "give {\"user_id\": ...} or leave it out")
    user = (metadata or {}).get("user_id")
    if user is not None and not isinstance(user, str):
        raise OaiError("metadata.user_id", "must be a string")
    top_k = body.get("top_k")
    stop = convert.strings(body, "stop_sequences") or []
    if not all(stop):
        raise OaiError("stop_sequences", "give a list of non-empty strings")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise OaiError("stop_sequences", f"{len(stop)} sequences; at most "
                                         f"{MAX_STOP_SEQUENCES}")
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise OaiError("top_p", "must be > 0")
    return OaiRequest(
        route="chat", model=model, prompts=None, messages=messages,
        max_tokens=max_tokens_of(body, "max_tokens", None), max_tokens_field="max_tokens",
        temperature=number(body, "temperature", 1.0, 0.0, 1.0), top_p=top_p, n=1,
        stop=tuple(unicode(s, "stop_sequences") for s in stop), seed=None,
        top_logprobs=None, echo=False, stream=convert.flag(body, "stream"),
        include_usage=False, user=user, tools=tools,
        top_k=-1 if top_k is None else integer(body, "top_k", -1, 1, 2**31 - 1),
        continue_final=prefill)


def _prefill(messages: tuple[dict[str, Any], ...]) -> tuple[tuple[dict[str, Any], ...], bool]:
    """The messages, and whether the last is an assistant's text to continue (Anthropic's
    prefill); an empty final assistant message starts nothing, and is left out."""
    last = messages[-1]
    if last["role"] != "assistant":
        return messages, False
    if last.get("tool_calls"):
        raise OaiError("messages", "the final assistant message is continued (a "
                                   "prefill), so it holds text only; answer its tool_use "
                                   "blocks with a user message of tool_result blocks")
    if not last["content"]:
        return messages[:-1], False
    return messages, True


def _messages(value: Any, system: Any) -> tuple[dict[str, Any], ...]:
    """The template's messages: `system` first, then each turn's text, its calls (an
    assistant's `tool_use`) or the tools' answers (a user's `tool_result`)."""
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": _texts(system, "system")})
    if not isinstance(value, list) or not value:
        raise OaiError("messages", "required: a non-empty list of messages")
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise OaiError(where, "must be an object with role and content")
        if extra := sorted(set(message) - {"role", "content"}):
            raise OaiError(f"{where}.{extra[0]}", "not served here")
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise OaiError(f"{where}.role", f"{role!r}; give \"user\" or \"assistant\"")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": unicode(content, f"{where}.content")})
            continue
        if not isinstance(content, list) or not content:
            raise OaiError(f"{where}.content", "give a string or a non-empty list of blocks")
        out.extend(_turn(role, content, f"{where}.content"))
    return tuple(out)


def _turn(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    answers: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        allowed = {"text": {"type", "text", "citations"},
                   "tool_use": {"type", "id", "name", "input"},
                   "tool_result": {"type", "tool_use_id", "content", "is_error"}}
        if kind not in allowed or (kind != "text"
                                   and (role == "user") == (kind == "tool_use")):
            raise OaiError(f"{at}.type", f"{kind!r}; a {role} turn takes "
                           + ("text and tool_result" if role == "user" else
                              "text and tool_use") + " blocks")
        if extra := sorted(k for k in set(block) - allowed[kind] if block[k] is not None):
            raise OaiError(f"{at}.{extra[0]}", "not served here")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise OaiError(f"{at}.text", "must be a string")
            texts.append(unicode(block["text"], f"{at}.text"))
        elif kind == "tool_use":
            if not isinstance(block.get("input"), dict):
                raise OaiError(f"{at}.input", "must be an object (the call's arguments)")
            name = block.get("name")
            read_tool(name, None, None, at, "input")      # the name's rules
            calls.append(call_message(string_field(block, "id", required=True), name,
                                      block["input"]))
        else:
            answer = block.get("content")
            text = "" if answer is None else _texts(answer, f"{at}.content")
            if convert.flag(block, "is_error", field=f"{at}.is_error"):
                text = TOOL_ERROR_PREFIX + text
            answers.append({"role": "tool", "content": text,
                            "tool_call_id": string_field(block, "tool_use_id", required=True)})
    if role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        return [{**turn, "tool_calls": calls} if calls else turn]
    return answers + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _texts(value: Any, where: str) -> str:
    """A string, or a list of text blocks, as one text."""
    if isinstance(value, str):
        return unicode(value, where)
    if isinstance(value, list):
        texts = []
        for j, block in enumerate(value):
            if not isinstance(block, dict) or block.get("type") != "text" \
                    or not isinstance(block.get("text"), str):
                raise OaiError(f"{where}[{j}]", "only text blocks are served here")
            if extra := sorted(k for k in set(block) - {"type", "text", "citations"}
                               if block[k] is not None):
                raise OaiError(f"{where}[{j}].{extra[0]}", "not served here")
            texts.append(unicode(block["text"], f"{where}[{j}].text"))
        return "".join(texts)
    raise OaiError(where, "give a string or a list of text blocks")


def _tool_use(tools: Any, choice: Any) -> ToolUse | None:
    """Anthropic's `tools` and `tool_choice`: None where the reply is text."""
    if tools is not None and not isinstance(tools, list):
        raise OaiError("tools", "give a list of {\"name\", \"description\", "
                                "\"input_schema\"}")
    read = []
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise OaiError(f"tools[{i}]", "must be an object")
        if tool.get("type") not in (None, "custom"):
            raise OaiError(f"tools[{i}].type", f"{tool['type']!r}: server tools are not "
                                               "served; give your own tools")
        if extra := sorted(k for k in set(tool) - {"name", "description", "input_schema",
                                                   "type"} if tool[k] is not None):
            raise OaiError(f"tools[{i}].{extra[0]}", "not served here")
        if tool.get("input_schema") is None:
            raise OaiError(f"tools[{i}].input_schema", "required, a JSON schema object")
        read.append(read_tool(tool.get("name"), tool.get("description"),
                              tool["input_schema"], f"tools[{i}]", "input_schema"))
    offered = check_tools(read, "tools")
    if choice is None:
        return ToolUse(offered) if offered else None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise OaiError("tool_choice.type", f"{kind!r}; give \"auto\", \"any\", \"tool\" "
                                           "or \"none\"")
    if extra := sorted(k for k in set(choice) - {"type", "name", "disable_parallel_tool_use"}
                       if choice[k] is not None):
        raise OaiError(f"tool_choice.{extra[0]}", "not served here")
    if choice.get("disable_parallel_tool_use"):
        raise OaiError("tool_choice.disable_parallel_tool_use",
                       "true is not served (a reply may hold several calls)")
    if kind == "none" or (kind == "auto" and not offered):
        return None
    if not offered:
        raise OaiError("tool_choice", f"{kind!r} needs tools")
    if kind == "auto":
        return ToolUse(offered)
    if kind == "any":
        return ToolUse(offered, "required")
    name = choice.get("name")
    if name not in {tool.name for tool in offered}:
        raise OaiError("tool_choice.name", f"{name!r} is not among the tools")
    return ToolUse(offered, "named", name)
