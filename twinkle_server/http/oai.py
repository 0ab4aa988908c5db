"""OpenAI-compatible inference on the HTTP port, as hosted Tinker serves it:
`GET /oai/api/v1/models` (and one by its id), `POST /oai/api/v1/completions` and
`POST /oai/api/v1/chat/completions`, streamed (server-sent events) or not.

`model` is a served base model's name or alias, a sampler checkpoint
(`tinker://<run>/sampler_weights/<name>`, or its `twinkle://` form) or external weights
(an export, or an imported adapter), or `<base name>;<checkpoint path>`. The key is the Tinker API key (`Authorization: Bearer`),
with the same tenant isolation: another tenant's checkpoint is not found, a published one
is readable. Each request samples through the runtime's sessionless verb
(`Sampling.sample_from`), so it runs in the same decode pool, fair with training and with
Tinker sampling, leaves no session behind, and a client that goes away (a closed stream,
a dropped connection) ends its request, freeing its rows.

Logprobs are those of the sampled tokens under the model's own distribution (Tinker's
sampler logprobs, untempered). A stream carries each choice's text as it is decoded, a
chunk a decode slice, then its finish reason, the usage when asked, and `data: [DONE]`.
A chat request's `tools` are rendered by the model's own chat template and its calls read
back into `tool_calls` in that template's format (`tool_calls`). Errors have OpenAI's
shape, `{"error": {"message", "type", "param", "code"}}`. The answers' shapes and the
error body live in `oai_reply`; the text as it decodes, in `decoded`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from twinkle_server.engine import WEIGHTS_FILE, checks
from twinkle_server.engine.errors import (
    Cancelled,
    EngineError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from twinkle_server.engine.types import Progress, SampleRequest, SamplingParams
from twinkle_server.http import convert, oai_request
from twinkle_server.http.app import Front, admitted, json_body
from twinkle_server.http.oai_reply import Reply, error_response
from twinkle_server.http.oai_request import OaiError, OaiRequest
from twinkle_server.http.tool_calls import ToolFormat, ToolUse, format_of
from twinkle_server.runtime import CheckpointRef, checkpoint_ref
from twinkle_server.runtime.bases import Served
from twinkle_server.runtime.sampling import Source, context_left
from twinkle_server.store import CheckpointRow, RunRow

log = logging.getLogger("twinkle_server.http")
PREFIX = "/oai/api/v1"
MODELS_LISTED = 100
"""Of the caller's own checkpoints, the newest this many are looked at by `/models`,
which lists those that serve (sampler weights, exports, imports); any of them, and any
published one, can be named."""
def chat_prompt(tokenizer: Any, messages: Sequence[dict[str, Any]], model: str,
                tools: ToolUse | None = None, forced: str = "",
                continue_final: bool = False) -> np.ndarray:
    """`messages` (and `tools`) through `tokenizer`'s chat template, then `forced` (the
    start of the reply a tool choice requires), as token ids. The template opens a new
    assistant turn, or with `continue_final` leaves the last message open for the reply to
    go on (Anthropic's prefill; OpenAI's chat answers a final assistant message with a
    turn of its own). A template that refuses the messages (`raise_exception` in it: a
    system role it does not take, say), or cannot leave the last one open, is the
    request's error, naming `messages` and the template's words."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise OaiError("messages", f"model {model!r} has no chat template; use /completions")
    try:
        text = tokenizer.apply_chat_template(
            list(messages), tools=[t.for_template() for t in tools.tools] if tools else None,
            tokenize=False, add_generation_prompt=not continue_final,
            continue_final_message=continue_final)
    except TemplateError as exc:
        raise OaiError("messages", f"model {model!r}'s chat template refuses them: "
                                   f"{exc}") from None
    except ValueError as exc:   # transformers: the final message is not in the rendering
        if not continue_final:
            raise
        raise OaiError("messages", f"model {model!r}'s chat template cannot continue the "
                                   f"final assistant message: {exc}") from None
    return np.asarray(tokenizer.encode(text + forced, add_special_tokens=False), np.int64)


def tool_format(served: Served, tools: ToolUse | None, field: str) -> ToolFormat | None:
    """How `served`'s model writes its replies: where a request offers `tools` (named by
    `field`), its calls (a model whose template writes none this server reads is
    refused); with or without tools, a Harmony model's channels (`tool_calls.Harmony`).
    None: plain text."""
    found = format_of(getattr(served.engine.base.tokenizer, "chat_template", None))
    if tools is None:
        return found if isinstance(found, ToolFormat) and found.special_tokens else None
    if isinstance(found, str):
        raise OaiError(field, f"model {served.name!r} takes no tools here: {found}")
    return found


@dataclass(frozen=True)
class Prompted:
    """A request's prompts as token ids, the tool format its replies are read in (None:
    text), and the start of each reply its prompts already hold (`ToolFormat.forced`)."""

    prompts: list[np.ndarray]
    tool_format: ToolFormat | None
    forced: str


class OpenAIRoutes:
    """The OpenAI-compatible routes over the HTTP front's runtime and auth."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.rt = front.rt

    # ------------------------------------------------------------------ models

    async def models(self, request: Request) -> Response:
        try:
            tenant = self.front.tenant(request)
        except Exception as exc:
            return error_response(exc)
        data = [self._base_entry(name, served)
                for served in self.rt.bases for name in served.model.names]
        page = self.rt.runs.list_checkpoints(tenant, limit=MODELS_LISTED)
        for row, run in page.items:
            try:
                data.append(self._checkpoint_entry(tenant, row, run))
            except EngineError:   # a checkpoint that does not serve: not listed
                continue
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """One entry of `/models` by its id (OpenAI's `models.retrieve`): a base's name
        or alias, or a checkpoint path the caller may read, listed or not."""
        try:
            tenant = self.front.tenant(request)
            name = request.path_params["model"]
            if not name:
                raise NotFound("model: give a model's id after /models/")
            if not name.startswith(("tinker://", "twinkle://")):
                return JSONResponse(self._base_entry(name, self._base(name)))
            row, _ = self.rt.checkpoint(tenant, _model_ref(name))
            return JSONResponse(self._checkpoint_entry(tenant, row))
        except NotFound as exc:
            exc.param = "model"   # type: ignore[attr-defined]
            return error_response(exc)
        except Exception as exc:
            return error_response(exc)

    @staticmethod
    def _base_entry(name: str, served: Served) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "twinkle",
                "root": served.name}

    def _checkpoint_entry(self, tenant: str, row: CheckpointRow,
                          run: RunRow | None = None) -> dict[str, Any]:
        """`row`'s entry, its root the base it was trained on. Sampler weights, plain
        exports and imports serve; training state, exports encrypted with age
        (`<file>.age`) and checkpoints of a base this server no longer serves do not
        (NotFound, naming why)."""
        path = convert.tinker_path(row)
        weights = self.rt.store.checkpoint_root / row.rel_path / WEIGHTS_FILE
        if row.kind == "training" or not weights.is_file():
            raise NotFound(f"model: {path!r} holds no weights that sample (a training "
                           "checkpoint, or an export encrypted with age)")
        try:
            root = self.rt.checkpoint_base(row, "model", run=run).name
        except FailedPrecondition as exc:
            raise NotFound(str(exc)) from None
        return {"id": path, "object": "model", "created": int(row.created_at),
                "owned_by": tenant if row.tenant == tenant else "published", "root": root}

    # ------------------------------------------------------------------ completions

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def _serve(self, request: Request, route: str) -> Response:
        try:
            tenant = self.front.tenant(request)
            asked = oai_request.read(route, await json_body(request))
            source = self.source(tenant, asked)
            served = source.served
            prompted = await self.prompted(served, asked)
            reply = Reply(route, asked, served, prompted.prompts, prompted.tool_format,
                          prompted.forced)
            work = await self.start(tenant, source, asked, prompted.prompts,
                                    reply.decoded.hear)
        except Exception as exc:
            return error_response(exc)
        return await answer(request, reply, work, asked.stream, error_response)

    def source(self, tenant: str, asked: OaiRequest) -> Source:
        """What `asked.model` names: a served base, a sampler checkpoint, or
        `<base>;<checkpoint>`."""
        base, _, path = asked.model.partition(";") if ";" in asked.model \
            else ("", "", asked.model)
        if not path.startswith(("tinker://", "twinkle://")):
            if ";" in asked.model:
                raise OaiError("model", f"{asked.model!r}: after ';' give a checkpoint path "
                                        "(tinker://<run>/sampler_weights/<name>)")
            return Source(self._base(path), tenant=tenant)
        ref = _model_ref(path)
        if ref.kind == "training":
            raise OaiError("model", f"{path!r} is a training checkpoint; name one saved for "
                                    "sampling (.../sampler_weights/...) or external weights")
        if base:
            self._base(base)
        try:
            source = self.rt.sampling.source(tenant, ref, base)
        except InvalidArgument as exc:   # the checkpoint's base is not `base`
            raise OaiError("model", str(exc)) from None
        except NotFound as exc:          # no such checkpoint (or another tenant's)
            exc.param = "model"          # type: ignore[attr-defined]
            raise
        if source.weights_path is None or not (Path(source.weights_path)
                                               / WEIGHTS_FILE).is_file():
            raise OaiError("model", f"{path!r} holds no weights this server can read (an "
                                    "export encrypted with age is for its owner to decrypt)")
        return source

    def _base(self, name: str) -> Served:
        """The served base `name`: not served is OpenAI's 404, model_not_found."""
        try:
            return self.rt.base(name, "model")
        except InvalidArgument as exc:
            missing = NotFound(str(exc))
            missing.param = "model"      # type: ignore[attr-defined]
            raise missing from None

    async def prompted(self, served: Served, asked: OaiRequest, checked: bool = True
                       ) -> Prompted:
        """`asked`'s prompts for `served`, and how its replies write tool calls; with
        `checked`, within the model's limits (what the engine would refuse, refused here:
        a stream's 200 goes out first). The chat template and the tokenizer run on a
        worker thread: a long prompt (seconds for megabytes of text) must not stall the
        server's one event loop, which answers every other request meanwhile."""
        writes_calls = tool_format(served, asked.tools, "tools")
        forced = writes_calls.forced(asked.tools) if writes_calls and asked.tools else ""
        prompts = await asyncio.to_thread(self._prompts, served, asked, forced)
        if checked:
            check_sizes(served, asked, prompts)
        return Prompted(prompts, writes_calls, forced)

    def _prompts(self, served: Served, asked: OaiRequest, forced: str) -> list[np.ndarray]:
        """Each prompt as token ids: text through the model's tokenizer, chat messages
        (and tools) through its chat template, followed by `forced`."""
        tokenizer = served.engine.base.tokenizer
        if asked.messages is not None:
            return [chat_prompt(tokenizer, asked.messages, served.name, asked.tools,
                                forced, asked.continue_final)]
        vocab = served.engine.base.vocab_size
        out = []
        for i, prompt in enumerate(asked.prompts or ()):
            ids = (np.asarray(prompt, np.int64) if isinstance(prompt, tuple)
                   else np.asarray(tokenizer.encode(prompt), np.int64))
            if ids.size == 0:
                raise OaiError("prompt", f"item {i} encodes to no tokens")
            if ids.min() < 0 or ids.max() >= vocab:
                raise OaiError("prompt", f"item {i}: token ids must be in [0, {vocab})")
            out.append(ids)
        return out

    async def start(self, tenant: str, source: Source, asked: OaiRequest,
                    prompts: Sequence[np.ndarray],
                    hear: Callable[[int], Callable[[Progress], None] | None]
                    ) -> asyncio.Future:
        """Every prompt's `n` choices, checked now and queued, sampled without a session
        (`Sampling.sample_from`: their prompts could never be reused, and kept they would
        push live sessions' cached prefixes out of the pool first); `hear(p)` listens to
        prompt p's progress (None: no progress wanted). Returns once all are queued: one
        refused past the queue bounds raises here (429, before a stream's 200), and the
        ones queued before it are cancelled. Cancelling the returned future (a client gone
        away) cancels them."""
        params = SamplingParams(max_tokens=asked.max_tokens or 0,
                                temperature=asked.temperature, top_p=asked.top_p,
                                top_k=asked.top_k, stop_strings=asked.stop,
                                seed=asked.seed)
        if asked.user:
            log.info("oai request tenant=%s user=%r model=%s", tenant, asked.user,
                     asked.model)
        echoed = asked.echo and asked.top_logprobs is not None
        checked: list[Any] = []
        try:
            for p, prompt in enumerate(prompts):
                checked.append(self.rt.sampling.sample_from(
                    source, prompt, asked.n, params, include_prompt_logprobs=echoed,
                    topk_prompt_logprobs=asked.top_logprobs or 0 if echoed else 0,
                    topk_sample_logprobs=asked.top_logprobs or 0, on_progress=hear(p)))
        except BaseException:
            for work in checked:   # refused before any of them was queued
                work.close()
            raise
        queued: list[asyncio.Future] = []
        try:
            for work in checked:
                queued.append(await admitted(lambda work=work: asyncio.ensure_future(work)))
        except BaseException:
            for task in queued:
                task.cancel()
            for work in checked[len(queued) + 1:]:
                work.close()
            raise
        return asyncio.gather(*queued)

    def routes(self) -> list[Route]:
        served = [Route(f"{PREFIX}/models", self.models, methods=["GET"]),
                  Route(f"{PREFIX}/models/{{model:path}}", self.model, methods=["GET"]),
                  Route(f"{PREFIX}/completions", self.completions, methods=["POST"]),
                  Route(f"{PREFIX}/chat/completions", self.chat_completions,
                        methods=["POST"])]
        return served + [Route(f"{PREFIX}/{{rest:path}}", _unserved(served),
                               methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]


def _model_ref(text: str) -> CheckpointRef:
    """The checkpoint path a request names as its `model`, or its error naming `model`."""
    try:
        return checkpoint_ref(text, "model")
    except Exception as exc:
        raise OaiError("model", str(exc).removeprefix("model: ")) from None


def _unserved(served: Sequence[Route]) -> Callable[[Request], Awaitable[Response]]:
    """What any other request under the prefix gets, in OpenAI's error shape: 405 for a
    served route's other methods, 404 (naming the served routes) for anything else."""
    async def answer(request: Request) -> Response:
        path = request.url.path
        for route in served:
            if route.path == path:
                return JSONResponse({"error": {
                    "message": f"{request.method} {path}: use {sorted(route.methods or ())}",
                    "type": "invalid_request_error", "param": None,
                    "code": "method_not_allowed"}}, 405)
        return JSONResponse({"error": {
            "message": f"{request.method} {path}: not served here; this server serves "
                       f"{[r.path for r in served]}",
            "type": "invalid_request_error", "param": None, "code": "unknown_url"}}, 404)
    return answer


def check_sizes(served: Served, asked: OaiRequest, prompts: Sequence[np.ndarray]) -> None:
    """Each prompt's sample within the model's limits (`checks.sample_size`, as the
    engine will check it), named by the request's own fields."""
    limit = served.model.max_seq_len
    for i, prompt in enumerate(prompts):
        tokens = asked.max_tokens or context_left(served, prompt.size)
        try:
            checks.sample_size(SampleRequest(None, None, prompt, asked.n,
                                             SamplingParams(max_tokens=tokens)),
                               served.engine.limits)
        except InvalidArgument:
            # The prompt, when it leaves no room for one token; else the tokens asked.
            field = asked.max_tokens_field if prompt.size < limit else (
                "messages" if asked.messages is not None else "prompt")
            raise OaiError(field, f"prompt {i} ({prompt.size} tokens) + {tokens} tokens to "
                                  f"draw, x n = {asked.n}, is over this model's limits "
                                  f"({limit} tokens a sequence, "
                                  f"{served.engine.limits.max_batch_tokens} a request)"
                           ) from None


async def answer(request: Request, reply: Any, work: asyncio.Future, stream: bool,
                 error: Callable[[BaseException], Response]) -> Response:
    """`reply` to `work` (a route's `Reply` or `Message`): its events as they come, or
    its whole body once done; a failure in the route's own error shape (`error`)."""
    if stream:
        return StreamingResponse(reply.stream(work), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    try:
        return JSONResponse(reply.whole(await unless_gone(request, work)))
    except Exception as exc:
        return error(exc)


async def unless_gone(request: Request, work: asyncio.Future, poll_s: float = 0.1) -> Any:
    """`work`'s result, or its cancellation (and with it its samples') once the client
    has gone away: a dropped connection frees the rows it held."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=poll_s)
        if done:
            return work.result()
        if await request.is_disconnected():
            work.cancel()
            raise Cancelled("the client went away before the completion was ready")
