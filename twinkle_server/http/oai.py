"""OpenAI-compatible inference on the HTTP port, as hosted Tinker serves it:
`GET /oai/api/v1/models`, `POST /oai/api/v1/completions` and
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
sampler logprobs, untempered). A stream carries the completion in one content chunk
once it is decoded, then its finish reason, the usage when asked, and `data: [DONE]`.
Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from twinkle_server.engine import WEIGHTS_FILE, checks
from twinkle_server.engine.errors import Cancelled, EngineError, InvalidArgument, NotFound
from twinkle_server.engine.types import Progress, SampledSequence, SampleRequest, SamplingParams
from twinkle_server.http import oai_request
from twinkle_server.http.app import Front, json_body
from twinkle_server.http.errors import category_of, message_of
from twinkle_server.http.oai_request import OaiError, OaiRequest
from twinkle_server.runtime import checkpoint_ref
from twinkle_server.runtime.bases import Served
from twinkle_server.runtime.sampling import SampleResult, Source, context_left
from twinkle_wire import paths

log = logging.getLogger("twinkle_server.http")
PREFIX = "/oai/api/v1"
MODELS_LISTED = 100
"""Of the caller's own checkpoints, the newest this many are looked at by `/models`,
which lists those that serve (sampler weights, exports, imports); any of them, and any
published one, can be named."""
ERRORS = {
    "invalid_argument": (400, "invalid_request_error"),
    "failed_precondition": (400, "invalid_request_error"),
    "unauthenticated": (401, "authentication_error"),
    "permission_denied": (403, "permission_error"),
    "not_found": (404, "invalid_request_error"),
    "resource_exhausted": (429, "rate_limit_error"),
    "cancelled": (499, "invalid_request_error"),
    "unavailable": (503, "server_error"),
}


def error_response(exc: BaseException) -> JSONResponse:
    """OpenAI's error body and the status for `exc`."""
    category = category_of(exc)
    status, kind = ERRORS.get(category, (500, "server_error"))
    param = getattr(exc, "param", None)
    code = {"unauthenticated": "invalid_api_key",
            "not_found": "model_not_found" if param == "model" else None}.get(category)
    return JSONResponse({"error": {"message": message_of(exc), "type": kind,
                                   "param": param, "code": code}}, status)


def chat_prompt(tokenizer: Any, messages: Sequence[dict[str, str]], model: str
                ) -> np.ndarray:
    """`messages` through `tokenizer`'s chat template, as token ids. A template that
    refuses the messages (`raise_exception` in it: a system role it does not take, say)
    is the request's error, naming `messages` and the template's words."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        raise OaiError("messages", f"model {model!r} has no chat template; use /completions")
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=True)
    except TemplateError as exc:
        raise OaiError("messages", f"model {model!r}'s chat template refuses them: "
                                   f"{exc}") from None
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), np.int64)


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
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "twinkle",
                 "root": served.name}
                for served in self.rt.bases for name in served.model.names]
        page = self.rt.runs.list_checkpoints(tenant, limit=MODELS_LISTED)
        for row, run in page.items:
            weights = self.rt.store.checkpoint_root / row.rel_path / WEIGHTS_FILE
            # Sampler weights, plain exports and imports serve; training state and exports
            # encrypted with age (`<file>.age`) do not.
            if row.kind == "training" or not weights.is_file():
                continue
            try:
                root = self.rt.checkpoint_base(row, run=run).name
            except EngineError:   # trained on a base this server no longer serves
                continue
            data.append({"id": paths.tinker_path(row.run_id, row.checkpoint_id),
                         "object": "model", "created": int(row.created_at),
                         "owned_by": tenant, "root": root})
        return JSONResponse({"object": "list", "data": data})

    # ------------------------------------------------------------------ completions

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def _serve(self, request: Request, route: str) -> Response:
        try:
            tenant = self.front.tenant(request)
            asked = oai_request.read(route, await json_body(request))
            source = self._source(tenant, asked)
            served = source.served
            prompts = self._prompts(served, asked)
            # What the engine would refuse, refused here: a stream's 200 goes out first.
            _check_sizes(served, asked, prompts)
            reply = _Reply(route, asked, served, prompts)
            work = self._start(tenant, source, asked, prompts, reply.hear)
        except Exception as exc:
            return error_response(exc)
        if asked.stream:
            return StreamingResponse(reply.stream(work), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        try:
            return JSONResponse(reply.whole(await _unless_gone(request, work)))
        except Exception as exc:
            return error_response(exc)

    def _source(self, tenant: str, asked: OaiRequest) -> Source:
        """What `asked.model` names: a served base, a sampler checkpoint, or
        `<base>;<checkpoint>`."""
        base, _, path = asked.model.partition(";") if ";" in asked.model \
            else ("", "", asked.model)
        if not path.startswith(("tinker://", "twinkle://")):
            if ";" in asked.model:
                raise OaiError("model", f"{asked.model!r}: after ';' give a checkpoint path "
                                        "(tinker://<run>/sampler_weights/<name>)")
            return Source(self._base(path))
        try:
            ref = checkpoint_ref(path, "model")
        except Exception as exc:
            raise OaiError("model", str(exc).removeprefix("model: ")) from None
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

    def _prompts(self, served: Served, asked: OaiRequest) -> list[np.ndarray]:
        """Each prompt as token ids: text through the model's tokenizer, chat messages
        through its chat template."""
        tokenizer = served.engine.base.tokenizer
        if asked.messages is not None:
            return [chat_prompt(tokenizer, asked.messages, served.name)]
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

    def _start(self, tenant: str, source: Source, asked: OaiRequest,
               prompts: Sequence[np.ndarray],
               hear: Callable[[int], Callable[[Progress], None] | None]) -> asyncio.Future:
        """Every prompt's `n` choices, checked now and started, sampled without a session
        (`Sampling.sample_from`: their prompts could never be reused, and kept they would
        push live sessions' cached prefixes out of the pool first); `hear(p)` listens to
        prompt p's progress (None: no progress wanted). Cancelling the returned future (a
        client gone away) cancels them."""
        params = SamplingParams(max_tokens=asked.max_tokens or 0,
                                temperature=asked.temperature, top_p=asked.top_p,
                                stop_strings=asked.stop, seed=asked.seed)
        if asked.user:
            log.info("oai request tenant=%s user=%r model=%s", tenant, asked.user,
                     asked.model)
        started: list[Any] = []
        echoed = asked.echo and asked.top_logprobs is not None
        try:
            for p, prompt in enumerate(prompts):
                started.append(self.rt.sampling.sample_from(
                    source, prompt, asked.n, params, include_prompt_logprobs=echoed,
                    topk_prompt_logprobs=asked.top_logprobs or 0 if echoed else 0,
                    topk_sample_logprobs=asked.top_logprobs or 0, on_progress=hear(p)))
        except BaseException:
            for work in started:   # refused before any of them was queued
                work.close()
            raise
        return asyncio.gather(*started)

    def routes(self) -> list[Route]:
        served = [Route(f"{PREFIX}/models", self.models, methods=["GET"]),
                  Route(f"{PREFIX}/completions", self.completions, methods=["POST"]),
                  Route(f"{PREFIX}/chat/completions", self.chat_completions,
                        methods=["POST"])]
        return served + [Route(f"{PREFIX}/{{rest:path}}", _unserved(served),
                               methods=["GET", "POST", "PUT", "PATCH", "DELETE"])]


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


def _check_sizes(served: Served, asked: OaiRequest, prompts: Sequence[np.ndarray]) -> None:
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


async def _unless_gone(request: Request, work: asyncio.Future, poll_s: float = 0.1) -> Any:
    """`work`'s result, or its cancellation (and with it its samples') once the client
    has gone away: a dropped connection frees the rows it held."""
    while True:
        done, _ = await asyncio.wait({work}, timeout=poll_s)
        if done:
            return work.result()
        if await request.is_disconnected():
            work.cancel()
            raise Cancelled("the client went away before the completion was ready")


class _Reply:
    """One request's answer, whole or streamed, in OpenAI's shapes."""

    def __init__(self, route: str, asked: OaiRequest, served: Served,
                 prompts: Sequence[np.ndarray]) -> None:
        self.route, self.asked, self.prompts = route, asked, prompts
        # Token by token: a stream whose chunks carry text only (logprobs and echo come
        # whole, in one chunk a choice, once it is decoded).
        self.incremental = asked.stream and asked.top_logprobs is None and not asked.echo
        self._progress: asyncio.Queue[tuple[int, Progress]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        # What each choice's stream has carried so far.
        self._sent: dict[int, str] = {}
        self.base = served.engine.base
        self.tokenizer = served.engine.base.tokenizer
        self.id = ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if route == "chat" else "text_completion"

    def _choices(self, results: Sequence[SampleResult]) -> list[dict[str, Any]]:
        choices = []
        for p, result in enumerate(results):
            for s, seq in enumerate(result.sequences):
                choices.append(self._choice(p * self.asked.n + s, p, seq, result))
        return choices

    def _choice(self, index: int, prompt: int, seq: SampledSequence,
                result: SampleResult) -> dict[str, Any]:
        # The engine searched for the stop strings in this same text and says where the
        # one it stopped on begins: OpenAI's text leaves it out.
        text = self.base.decode(seq.tokens.tolist())[:seq.stop_text_at]
        finish = "stop" if seq.stop_reason == "stop" else "length"
        if self.route == "chat":
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": self._chat_logprobs(seq), "finish_reason": finish}
        logprobs = self._completion_logprobs(seq, prompt, result)
        if self.asked.echo:
            text = self._prompt_text(prompt) + text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _prompt_text(self, prompt: int) -> str:
        return self.base.decode(self.prompts[prompt].tolist())

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([int(token)])

    def _chat_logprobs(self, seq: SampledSequence) -> dict[str, Any] | None:
        if self.asked.top_logprobs is None:
            return None
        content = []
        for i, (token, logprob) in enumerate(zip(seq.tokens, seq.logprobs, strict=True)):
            piece = self._piece(token)
            top = []
            if seq.topk_token_ids is not None and seq.topk_logprobs is not None:
                top = [{"token": self._piece(t), "logprob": float(lp),
                        "bytes": list(self._piece(t).encode())}
                       for t, lp in zip(seq.topk_token_ids[i], seq.topk_logprobs[i],
                                        strict=True)][:self.asked.top_logprobs]
            content.append({"token": piece, "logprob": float(logprob),
                            "bytes": list(piece.encode()), "top_logprobs": top})
        return {"content": content}

    def _completion_logprobs(self, seq: SampledSequence, prompt: int,
                             result: SampleResult) -> dict[str, Any] | None:
        if self.asked.top_logprobs is None:
            return None
        tokens: list[int] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if self.asked.echo and (scored := result.prompt_logprobs) is not None:
            ids = self.prompts[prompt].tolist()
            tokens += ids
            values += [None] + [float(v) for v in scored.logprobs[1:]]
            tops += [None] + [self._top(ids[i], float(scored.logprobs[i]),
                                        scored.topk_token_ids, scored.topk_logprobs, i)
                              for i in range(1, len(ids))]
        tokens += seq.tokens.tolist()
        values += [float(v) for v in seq.logprobs]
        tops += [self._top(int(t), float(lp), seq.topk_token_ids, seq.topk_logprobs, i)
                 for i, (t, lp) in enumerate(zip(seq.tokens, seq.logprobs, strict=True))]
        pieces = [self._piece(t) for t in tokens]
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        return {"tokens": pieces, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def _top(self, chosen: int, logprob: float, ids: np.ndarray | None,
             logprobs: np.ndarray | None, position: int) -> dict[str, float]:
        """One position's `top_logprobs` dict: its k likeliest tokens and, as OpenAI
        gives it, the chosen one too (so k or k + 1 entries)."""
        top: dict[str, float] = {}
        if ids is not None and logprobs is not None:
            for t, lp in list(zip(ids[position], logprobs[position],
                                  strict=True))[:self.asked.top_logprobs]:
                top.setdefault(self._piece(t), float(lp))
        top.setdefault(self._piece(chosen), logprob)
        return top

    def _usage(self, results: Sequence[SampleResult]) -> dict[str, int]:
        prompt = sum(int(p.size) for p in self.prompts)
        completion = sum(int(s.tokens.size) for r in results for s in r.sequences)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def whole(self, results: Sequence[SampleResult]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.asked.model, "choices": self._choices(results),
                "usage": self._usage(results)}

    def hear(self, prompt: int) -> Callable[[Progress], None] | None:
        """The listener for prompt `prompt`'s progress (from the scheduler's thread onto
        this loop), or None where the reply is not streamed token by token."""
        if not self.incremental:
            return None
        loop, queue = self._loop, self._progress
        return lambda progress: loop.call_soon_threadsafe(queue.put_nowait,
                                                          (prompt, progress))

    async def stream(self, work: asyncio.Future) -> AsyncIterator[str]:
        """Server-sent events: for chat, each choice's role first; each choice's text as
        it is decoded (a chunk a decode slice; whole, once decoded, when logprobs or echo
        are asked), then its finish reason; the usage when asked; `[DONE]`. A client gone
        away cancels this, and with it the request's samples."""
        chunk = {"id": self.id, "object": f"{self.object}.chunk" if self.route == "chat"
                 else self.object, "created": self.created, "model": self.asked.model}
        count = len(self.prompts) * self.asked.n
        heard: asyncio.Future | None = None
        try:
            if self.route == "chat":
                for index in range(count):
                    yield _event({**chunk, "choices": [{
                        "index": index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]})
            while not work.done():
                heard = asyncio.ensure_future(self._progress.get())
                await asyncio.wait({work, heard}, return_when=asyncio.FIRST_COMPLETED)
                if not heard.done():
                    break
                for index, text in self._partial_texts(*heard.result()):
                    yield _event({**chunk, "choices": [self._text_delta(index, text)]})
            try:
                results = work.result()
            except Exception as exc:
                yield _event(json.loads(error_response(exc).body))
                yield "data: [DONE]\n\n"
                return
            for choice in self._choices(results):
                for event in self._last_of(choice):
                    yield _event({**chunk, "choices": [event]})
            if self.asked.include_usage:
                yield _event({**chunk, "choices": [], "usage": self._usage(results)})
            yield "data: [DONE]\n\n"
        finally:
            work.cancel()
            if heard is not None:
                heard.cancel()

    def _partial_texts(self, prompt: int, progress: Progress) -> Iterator[tuple[int, str]]:
        """The new text of each of prompt `prompt`'s choices that may go out now: held
        back are the last characters a stop string could still begin in, and a character
        whose bytes have not all been drawn."""
        hold = max((len(s) for s in self.asked.stop), default=1) - 1
        for row, (tokens, stop_at) in enumerate(zip(progress.tokens, progress.stop_text_at,
                                                    strict=True)):
            index = prompt * self.asked.n + row
            text = self.base.decode(tokens.tolist())
            # A row stopped on a stop string ends where the engine says it begins.
            safe = len(text) - hold if stop_at is None else stop_at
            while safe > 0 and text[safe - 1] == "\ufffd":
                safe -= 1
            sent = self._sent.get(index, "")
            if safe > len(sent) and text.startswith(sent):
                self._sent[index] = text[:safe]
                yield index, text[len(sent):safe]

    def _text_delta(self, index: int, text: str, finish: str | None = None
                    ) -> dict[str, Any]:
        if self.route == "chat":
            return {"index": index, "delta": {"content": text} if text else {},
                    "logprobs": None, "finish_reason": finish}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}

    def _last_of(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        """A finished choice's last events: what its stream has not carried yet, with its
        logprobs, then its finish reason."""
        index, finish = choice["index"], choice.pop("finish_reason")
        text = choice["message"]["content"] if self.route == "chat" else choice["text"]
        rest = text[len(self._sent.get(index, "")):]
        if self.route == "chat":
            return [{"index": index, "delta": {"content": rest},
                     "logprobs": choice["logprobs"], "finish_reason": None},
                    self._text_delta(index, "", finish)]
        return [{**choice, "text": rest, "finish_reason": finish}]


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"
