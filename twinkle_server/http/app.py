"""The Tinker REST routes the stock `tinker` SDK (0.38) calls: session, model and op routes.

Each route authenticates (`X-API-Key`, the SDK's header, or `Authorization: Bearer`),
reads its body (`convert`), calls the runtime verb the gRPC front calls, and answers in
the SDK's shape. Ops answer at once with a future (`futures`) that `retrieve_future`
resolves; the SDK's `seq_id`s count from 1 per training client, the runtime's queues from
0, so op `seq_id` s is the runtime's s - 1. `Front` holds what every route shares (auth,
model aliases, futures) and the session, service and future routes; the training routes
are in `training`, the sampling routes in `sampling`, the run, checkpoint and session
listings of the SDK's `RestClient` in `rest`; `/metrics` in `metrics`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from twinkle_server.engine.errors import (
    Cancelled,
    EngineError,
    ResourceExhausted,
    Unauthenticated,
)
from twinkle_server.http import convert
from twinkle_server.http.errors import SDK_FIRST_SEQ_ID, BadBody, failed_response, status_for
from twinkle_server.http.futures import Futures
from twinkle_server.runtime import SUBMITTED, OpRef, Runtime, bearer_token

log = logging.getLogger("twinkle_server.http")
API_PREFIX = "/api/v1"
"""Where the SDK's routes live (`base_url` + this)."""
LEGACY_KEY_PREFIX = "tml-tw-"
"""The SDK accepts only keys that start with `tml-`; a key created before keys had that
prefix (`tw-...`) is sent as `tml-tw-...` and looked up without the `tml-`."""
Handler = Callable[["Front", Request], Awaitable[Any]]
SDK_MIN_BYTES_PER_TOKEN = 4
"""The fewest bytes the SDK counts per input token when it sizes a forward_backward chunk
(`_estimate_datum_bytes_count_proto`: 4 per model_input token, plus every loss input's own
bytes)."""
SDK_MAX_CHUNK_BYTES = 5_000_000
SDK_MAX_CHUNK_LEN = 1024
"""The SDK's own chunk caps (`ClientConfigResponse` defaults): bytes and datums."""
MAX_BODY_BYTES = 64 << 20
"""The most bytes of a request body any route reads. The SDK's largest body, a
forward_backward chunk, stays within its 5 MB estimate (`SDK_MAX_CHUNK_BYTES`, which
counts the protobuf's bytes), and a prompt at the longest context is a few MB of JSON;
past it a body is refused, naming the limit, before any of it is parsed."""


def fwdbwd_chunking(max_batch_tokens: int) -> dict[str, int]:
    """The client-config fields that size the SDK's forward_backward chunks, each chunk one
    request: a chunk closes before its estimate passes `fwdbwd_max_chunk_bytes_count`, and
    every token counts at least 4 bytes, so 4 x `--max-batch-tokens` (262,144 tokens: about
    1 MB, under the SDK's 5 MB) keeps every chunk within the limit, and a batch over it is
    sent as several requests whose gradients add up as one's. A single datum over the limit
    still goes alone, and is refused naming it."""
    return {"fwdbwd_max_chunk_bytes_count": min(SDK_MAX_CHUNK_BYTES,
                                                SDK_MIN_BYTES_PER_TOKEN * max_batch_tokens),
            "fwdbwd_max_chunk_len": min(SDK_MAX_CHUNK_LEN, max_batch_tokens)}


async def admitted(start: Callable[[], asyncio.Future]) -> asyncio.Future:
    """`start()`'s task (the task of an op's verb, which `start` creates), once its op is
    submitted to its model's scheduler, or done before that. An op refused past its queue
    bounds raises its refusal (`ResourceExhausted`, from `SUBMITTED`) here, so a route
    answers 429 before it promises anything (a future, a stream's 200)."""
    submitted = asyncio.get_running_loop().create_future()
    token = SUBMITTED.set(submitted)
    try:
        task = start()
    finally:
        SUBMITTED.reset(token)
    await asyncio.wait({submitted, task}, return_when=asyncio.FIRST_COMPLETED)
    if submitted.done() and (refused := submitted.result()) is not None:
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        raise refused
    return task


def route(fn: Handler) -> Callable[[Front, Request], Awaitable[Response]]:
    """Answer a handler's value as JSON (a `Response` as is), and any failure with its
    status from `errors.status_for`."""
    @functools.wraps(fn)
    async def wrapper(self: Front, request: Request) -> Response:
        try:
            value = await fn(self, request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            status, body, headers = status_for(exc)
            return JSONResponse(body, status, headers)
        return value if isinstance(value, Response) else JSONResponse(value)
    return wrapper


async def read_body(request: Request) -> bytes:
    """The request's body, refused (`BadBody`) once it passes `MAX_BODY_BYTES`: by its
    declared length before a byte is read, else as it arrives."""
    def refused(size: str) -> BadBody:
        return BadBody(f"body: {size} bytes, over the {MAX_BODY_BYTES} bytes "
                       f"({MAX_BODY_BYTES >> 20} MiB) a request may carry")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise refused(declared)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise refused(f"more than {MAX_BODY_BYTES}")
        chunks.append(chunk)
    return b"".join(chunks)


async def json_body(request: Request) -> dict[str, Any]:
    raw = await read_body(request)
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise BadBody("body: not JSON") from None
    if not isinstance(body, dict):
        raise BadBody("body: expected a JSON object")
    return body


class Front:
    """The HTTP front's state: the futures table and the SDK's model-id aliases."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.futures = Futures()
        # A training client created from a checkpoint names its model
        # "<session_id>:train:<model_seq_id>" before the server answers (tinker's
        # `_create_training_client_via_load_weights_submit`); the alias maps it to the run.
        self.aliases: dict[tuple[str, str], str] = {}

    # ------------------------------------------------------------------ helpers

    def tenant(self, request: Request, while_draining: bool = False) -> str:
        """The tenant of the request's API key (refused while the server drains, unless
        `while_draining`: reading an op's outcome); a legacy key the SDK sent as
        `tml-tw-...` is tried again as `tw-...`. The Bearer scheme's name is read in any
        case (RFC 7235), and an empty header counts as left out."""
        token = (request.headers.get("x-api-key")
                 or bearer_token(request.headers.get("authorization", "")))
        try:
            return self.rt.authenticate(token, while_draining)
        except Unauthenticated:
            if token and token.startswith(LEGACY_KEY_PREFIX):
                return self.rt.authenticate(token[len("tml-"):], while_draining)
            raise

    def alias(self, tenant: str, alias: str, run_id: str) -> None:
        """Let the SDK's own name `alias` for a model stand for its run `run_id`; the
        aliases of models no longer loaded are forgotten, so they do not pile up."""
        for (owner, name), run in list(self.aliases.items()):
            try:
                self.rt.model_of(owner, run)
            except EngineError:
                del self.aliases[(owner, name)]
        self.aliases[(tenant, alias)] = run_id

    def model(self, tenant: str, model_id: str) -> str:
        """The run id behind an SDK model id, checked to be the tenant's loaded model."""
        run_id = self.aliases.get((tenant, model_id), model_id)
        self.rt.model_of(tenant, run_id)
        return run_id

    def op(self, tenant: str, body: dict[str, Any], request_id: str) -> OpRef:
        return self.op_ref(tenant, convert.text(body, "model_id", required=True),
                           convert.integer(body, "seq_id"), request_id)

    def op_ref(self, tenant: str, model_id: str, seq_id: int | None,
               request_id: str) -> OpRef:
        """The runtime's op for the SDK's model id and seq_id (counted from 1)."""
        return OpRef(self.model(tenant, model_id),
                     None if seq_id is None else seq_id - SDK_FIRST_SEQ_ID,
                     request_id)

    async def promise(self, tenant: str, request_id: str, work: Awaitable[Any],
                      render: Callable[[Any], Any], **extra: Any) -> dict[str, Any]:
        """Start `work` as the tenant's future `request_id` and answer its id once its op
        is submitted; an op refused past its bounds (`admitted`) is answered here, HTTP
        429, and leaves no future (the SDK retries it)."""
        try:
            await admitted(lambda: self.futures.submit(tenant, request_id, work, render))
        except ResourceExhausted:
            self.futures.forget(tenant, request_id)
            raise
        return {"request_id": request_id, **extra}

    def refused(self, tenant: str, ref: OpRef, kind: str, error: Exception) -> BaseException:
        """The error to answer a refused op with, at once: the op has taken its seq_id
        (`Training.refuse`), and is not awaited, since the SDK sends the first chunk of a
        parallel forward_backward only after the others are answered."""
        return self.rt.training.refuse(tenant, ref, kind, error).error

    # ------------------------------------------------------------------ service

    @route
    async def healthz(self, request: Request) -> Any:
        if self.rt.draining:
            return JSONResponse({"status": "draining"}, 503)
        return {"status": "ok"}

    @route
    async def client_config(self, request: Request) -> Any:
        self.tenant(request)
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key",
                "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False,
                "use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False,
                **fwdbwd_chunking(min(s.model.max_batch_tokens for s in self.rt.bases))}

    @route
    async def dynamic_config(self, request: Request) -> Any:
        self.tenant(request)
        # The SDK sends `cancel_future` for a sample future its caller abandons (cancelled,
        # or timed out in `result_async`) only when this is on; the sample then leaves
        # the decode pool at its next step instead of decoding to `max_tokens`.
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}

    @route
    async def capabilities(self, request: Request) -> Any:
        self.tenant(request)
        return {"supported_models": [
            {"model_name": name, "max_context_length": model["max_context_length"],
             "trainable": model["trainable"], "sampleable": model["sampleable"]}
            for model in self.rt.runs.capabilities()["models"]
            for name in (model["name"], *model["aliases"])]}

    @route
    async def telemetry(self, request: Request) -> Any:
        return {"status": "accepted"}   # the SDK's own telemetry; nothing is kept

    @route
    async def create_session(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        tags = {str(t): "" for t in convert._field(body, "tags", list, [])}
        tags.update(convert.mapping(body, "user_metadata"))
        session_id = await self.rt.runs.create_session(tenant, tags)
        return {"type": "create_session", "session_id": session_id}

    @route
    async def heartbeat(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        await self.rt.runs.heartbeat(tenant, convert.text(body, "session_id", required=True))
        return {"type": "session_heartbeat"}

    @route
    async def finish_session(self, request: Request) -> Any:
        tenant = self.tenant(request)
        await self.rt.runs.close_session(tenant, request.path_params["session_id"])
        return JSONResponse(None)

    # ------------------------------------------------------------------ futures

    @route
    async def retrieve_future(self, request: Request) -> Any:
        """The result of `request_id` (in the body, or the path's
        `/retrieve_future/{request_id}` other Tinker tools call), or try again. Answered
        while the server drains too: the ops it finishes or fails then are still read."""
        tenant = self.tenant(request, while_draining=True)
        request_id = request.path_params.get("request_id") or convert.text(
            await json_body(request), "request_id", required=True)
        entry = self.futures.get(tenant, request_id)
        if not await self.futures.wait(entry):
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        self.futures.answered(entry)
        if entry.task.cancelled():
            return failed_response(Cancelled(f"request_id: {request_id!r} was cancelled "
                                             "(cancel_future) before it finished"))
        if entry.task.exception() is not None:
            return failed_response(entry.task.exception())
        rendered = entry.render(entry.task.result())
        if isinstance(rendered, bytes):
            return Response(rendered, media_type=convert.PROTOBUF)
        return rendered

    @route
    async def cancel_future(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        self.futures.cancel(tenant, convert.text(body, "request_id", required=True))
        return JSONResponse(None)

    def _id(self) -> str:
        return "fut-" + uuid.uuid4().hex[:16]

    # ------------------------------------------------------------------ routes

    def routes(self) -> list[Route]:
        table = [
            ("GET", "/healthz", self.healthz),
            ("POST", "/client/config", self.client_config),
            ("POST", "/client/dynamic_config", self.dynamic_config),
            ("GET", "/get_server_capabilities", self.capabilities),
            ("POST", "/telemetry", self.telemetry),
            ("POST", "/create_session", self.create_session),
            ("POST", "/session_heartbeat", self.heartbeat),
            ("POST", "/sessions/{session_id}/finish", self.finish_session),
            ("POST", "/retrieve_future", self.retrieve_future),
            ("POST", "/retrieve_future/{request_id}", self.retrieve_future),
            ("POST", "/cancel_future", self.cancel_future),
        ]
        return [Route(API_PREFIX + path, fn, methods=[method]) for method, path, fn in table] + [
            Route("/health", self.healthz, methods=["GET"])]   # what other Tinker tools probe
