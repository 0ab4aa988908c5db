"""Anthropic's Messages API on the HTTP port, as hosted Tinker serves it beside the OpenAI
route: `POST /anthropic/api/v1/messages` (whole or streamed) and
`POST /anthropic/api/v1/messages/count_tokens`, so `anthropic.Anthropic(base_url=
"http://host:port/anthropic/api")` and the agents built on it drive a checkpoint.

`model` names what the OpenAI route's does (a base, a sampler checkpoint, external
weights, `<base>;<path>`), with the same keys (`x-api-key` or Bearer) and isolation.
A request is read into the chat request the OpenAI route serves (`anthropic_request`) and
runs the same way (`OpenAIRoutes.source`, `prompts`, `start`): one sample in the decode
pool, its tool calls read back in the model's tool format (`tool_calls`), a dropped
client ending it. Only the shapes are Anthropic's: content blocks (`text`, `tool_use`),
`stop_reason` (`end_turn`, `max_tokens`, `stop_sequence`, `tool_use`), the stream's
events (`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`,
`message_stop`, `error`) and the error body `{"type": "error", "error": {"type",
"message"}}`.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from twinkle_server.http import anthropic_request
from twinkle_server.http.app import Front, json_body
from twinkle_server.http.decoded import Decoded, Finished
from twinkle_server.http.errors import category_of, message_of
from twinkle_server.http.oai import OpenAIRoutes, answer
from twinkle_server.http.oai_request import OaiRequest
from twinkle_server.runtime.sampling import SampleResult

PREFIX = "/anthropic/api/v1"
ERRORS = {
    "invalid_argument": (400, "invalid_request_error"),
    "failed_precondition": (400, "invalid_request_error"),
    "unauthenticated": (401, "authentication_error"),
    "permission_denied": (403, "permission_error"),
    "not_found": (404, "not_found_error"),
    "resource_exhausted": (429, "rate_limit_error"),
    "cancelled": (499, "invalid_request_error"),
    "unavailable": (503, "api_error"),
}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Anthropic's error body, and the status, for `exc`."""
    status, kind = ERRORS.get(category_of(exc), (500, "api_error"))
    return status, {"type": "error", "error": {"type": kind, "message": message_of(exc)}}


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    return JSONResponse(body, status)


class AnthropicRoutes:
    """The Messages routes over the OpenAI routes' way of running a chat request."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.chat = OpenAIRoutes(front)

    async def messages(self, request: Request) -> Response:
        try:
            tenant = self.front.tenant(request)
            asked = anthropic_request.read(await json_body(request))
            source = self.chat.source(tenant, asked)
            prompted = await self.chat.prompted(source.served, asked)
            reply = Message(asked, prompted.prompts, Decoded(
                source.served, asked.stop, 1, asked.stream, asked.tools,
                prompted.tool_format, prompted.forced))
            work = await self.chat.start(tenant, source, asked, prompted.prompts,
                                         reply.decoded.hear)
        except Exception as exc:
            return error_response(exc)
        return await answer(request, reply, work, asked.stream, error_response)

    async def count_tokens(self, request: Request) -> Response:
        try:
            tenant = self.front.tenant(request)
            asked = anthropic_request.read(await json_body(request), counting=True)
            served = self.chat.source(tenant, asked).served
            prompt, = (await self.chat.prompted(served, asked, checked=False)).prompts
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"input_tokens": int(prompt.size)})

    def routes(self) -> list[Route]:
        served = [Route(f"{PREFIX}/messages", self.messages, methods=["POST"]),
                  Route(f"{PREFIX}/messages/count_tokens", self.count_tokens,
                        methods=["POST"])]
        return served + [Route(f"{PREFIX}/{{rest:path}}", _unserved(served),
                               methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]


def _unserved(served: Sequence[Route]) -> Callable[[Request], Any]:
    """Any other request under the prefix, in Anthropic's error shape: 405 for a served
    route's other methods, 404 (naming the served routes) for anything else."""
    async def answer(request: Request) -> Response:
        path = request.url.path
        allowed = next((sorted(r.methods or ()) for r in served if r.path == path), None)
        message = (f"{request.method} {path}: use {allowed}" if allowed else
                   f"{request.method} {path}: not served here; this server serves "
                   f"{[r.path for r in served]}")
        return JSONResponse({"type": "error", "error": {
            "type": "invalid_request_error" if allowed else "not_found_error",
            "message": message}}, 405 if allowed else 404)
    return answer


class Message:
    """One request's answer as an Anthropic message, whole or as the stream's events."""

    def __init__(self, asked: OaiRequest, prompts: Sequence[np.ndarray],
                 decoded: Decoded) -> None:
        self.asked, self.decoded = asked, decoded
        self.input_tokens = sum(int(p.size) for p in prompts)
        self.id = "msg_" + uuid.uuid4().hex[:24]

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.asked.model}

    def whole(self, results: Sequence[SampleResult]) -> dict[str, Any]:
        seq = results[0].sequences[0]
        done = self.decoded.finished(seq)
        content: list[dict[str, Any]] = [{"type": "text", "text": done.text}] \
            if done.text else []
        content += [_tool_use(call.name, call.arguments) for call in done.calls]
        return {**self._head(), "content": content, **_stop(done),
                "usage": self._usage(int(seq.tokens.size))}

    def _usage(self, output_tokens: int) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "output_tokens": output_tokens}

    async def stream(self, work: asyncio.Future) -> AsyncIterator[str]:
        """Anthropic's events: the message, its text block as it decodes, its tool_use
        blocks once the reply is whole, the stop reason with the usage, the end."""
        try:
            yield _event("message_start", {"type": "message_start", "message": {
                **self._head(), "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": self._usage(0)}})
            blocks = 0
            async for delta in self.decoded.deltas(work):
                if blocks == 0:
                    yield _event(*_block_start(0, {"type": "text", "text": ""}))
                    blocks = 1
                yield _event(*_text_delta(0, delta.text))
            try:
                seq = work.result()[0].sequences[0]
            except Exception as exc:
                _, body = error_body(exc)
                yield _event("error", body)
                return
            done = self.decoded.finished(seq)
            for event in self._last(done, blocks):
                yield _event(*event)
            yield _event("message_delta", {"type": "message_delta", "delta": _stop(done),
                                           "usage": {"output_tokens": int(seq.tokens.size)}})
            yield _event("message_stop", {"type": "message_stop"})
        finally:
            work.cancel()

    def _last(self, done: Finished, opened: int) -> Iterator[tuple[str, dict[str, Any]]]:
        """The events a finished reply still owes: its text's rest (its block opened
        first when none was), that block's end, and one block a tool call."""
        rest = self.decoded.rest(0, done.text)
        if rest and not opened:
            yield _block_start(0, {"type": "text", "text": ""})
            opened = 1
        if rest:
            yield _text_delta(0, rest)
        if opened:
            yield "content_block_stop", {"type": "content_block_stop", "index": 0}
        for index, call in enumerate(done.calls, start=opened):
            block = _tool_use(call.name, {})
            yield _block_start(index, block)
            yield "content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta",
                          "partial_json": json.dumps(call.arguments)}}
            yield "content_block_stop", {"type": "content_block_stop", "index": index}


def _tool_use(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": name,
            "input": arguments}


def _stop(done: Finished) -> dict[str, Any]:
    reason = STOP_REASONS.get(done.reason) or (
        "stop_sequence" if done.stop_sequence is not None else "end_turn")
    return {"stop_reason": reason, "stop_sequence": done.stop_sequence}


def _block_start(index: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_start", {"type": "content_block_start", "index": index,
                                   "content_block": block}


def _text_delta(index: int, text: str) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index,
                                   "delta": {"type": "text_delta", "text": text}}


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"
