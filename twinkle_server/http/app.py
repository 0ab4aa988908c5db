"""The Tinker REST routes the stock `tinker` SDK (0.38) calls: session, model and op routes.

Each route authenticates (`X-API-Key`, the SDK's header, or `Authorization: Bearer`),
reads its body (`convert`), calls the runtime verb the gRPC front calls, and answers in
the SDK's shape. Ops answer at once with a future (`futures`) that `retrieve_future`
resolves; the SDK's `seq_id`s count from 1 per training client, the runtime's queues from
0, so op `seq_id` s is the runtime's s - 1. The run, checkpoint and session listings of
the SDK's `RestClient` are in `rest`; `/metrics` in `metrics`.
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

from twinkle_server.engine.errors import Cancelled, EngineError, InvalidArgument, Unauthenticated
from twinkle_server.engine.types import LoraSpec
from twinkle_server.http import convert, sampling_options
from twinkle_server.http.errors import BadBody, failed_response, status_for
from twinkle_server.http.futures import Futures
from twinkle_server.runtime import OpRef, Runtime, checkpoint_ref
from twinkle_server.runtime.runs import check_ttl
from twinkle_server.store import CheckpointRow
from twinkle_wire import paths

log = logging.getLogger("twinkle_server.http")
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


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
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
        self.sampler_paths: dict[str, str | None] = {}

    # ------------------------------------------------------------------ helpers

    def tenant(self, request: Request) -> str:
        """The tenant of the request's API key; a legacy key the SDK sent as `tml-tw-...`
        is tried again as `tw-...`."""
        token = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if token is None and auth.startswith("Bearer "):
            token = auth[7:]
        try:
            return self.rt.authenticate(token or None)
        except Unauthenticated:
            if token and token.startswith(LEGACY_KEY_PREFIX):
                return self.rt.authenticate(token[len("tml-"):])
            raise

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
        return OpRef(self.model(tenant, model_id), None if seq_id is None else seq_id - 1,
                     request_id)

    def promise(self, tenant: str, request_id: str, work: Awaitable[Any],
                render: Callable[[Any], Any], **extra: Any) -> dict[str, Any]:
        self.futures.submit(tenant, request_id, work, render)
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

    # ------------------------------------------------------------------ models

    @route
    async def create_model(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        lora = convert._field(body, "lora_config", dict, required=True)
        optimizer = convert._field(body, "optimizer_config", dict, {})
        if optimizer.get("type", "adamw") != "adamw":
            raise InvalidArgument(f"optimizer_config.type: {optimizer.get('type')!r}; this "
                                  "server runs AdamW only")
        base_model = convert.text(body, "base_model")
        self.rt.base(base_model).check_trains()
        spec = LoraSpec.from_tinker(convert.integer(lora, "rank", 32), convert.integer(lora, "seed"),
                                    bool(lora.get("train_mlp", True)),
                                    bool(lora.get("train_attn", True)),
                                    bool(lora.get("train_unembed", True)))
        session_id = convert.text(body, "session_id")
        work = self.rt.training.create_model(
            tenant, spec=spec, session_id=session_id, base_model=base_model,
            user_metadata=convert.mapping(body, "user_metadata"))
        return self.promise(tenant, self._id(), work, lambda info: {
            "type": "create_model", "model_id": info.entry.model_id})

    @route
    async def get_info(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        sdk_id = convert.text(body, "model_id", required=True)
        info = self.rt.training.info(tenant, self.model(tenant, sdk_id))
        return {"type": "get_info", "model_id": sdk_id, "is_lora": True,
                "lora_rank": info.spec.rank, "model_name": info.entry.base_model,
                "model_data": {"arch": info.arch, "model_name": info.entry.base_model,
                               "tokenizer_id": info.tokenizer_id}}

    @route
    async def unload_model(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        sdk_id = convert.text(body, "model_id", required=True)
        work = self.rt.training.unload_model(tenant, self.model(tenant, sdk_id))
        return self.promise(tenant, self._id(), work,
                            lambda _: {"type": "unload_model", "model_id": sdk_id})

    # ------------------------------------------------------------------ training ops

    @route
    async def forward_backward(self, request: Request) -> Any:
        tenant = self.tenant(request)
        if request.headers.get("content-encoding", "identity") != "identity":
            raise BadBody("content-encoding: send the body uncompressed (the server's "
                          "client/config sets proto_compress_fwdbwd false)")
        msg, datums, loss = convert.forward_request(
            await request.body(), lambda sdk_id, total: self.rt.training.check_tokens(
                self.aliases.get((tenant, sdk_id), sdk_id), total))
        ref = self.op_ref(tenant, msg.model_id, msg.seq_id, rid := self._id())
        backward = not msg.forward_only
        kind = "forward_backward" if backward else "forward"
        try:
            if isinstance(datums, Exception):
                raise datums
            forward = self.rt.training.forward_request(tenant, ref.model_id, datums, loss,
                                                       backward, convert.provenance(msg))
        except (EngineError, ValueError) as exc:
            raise self.refused(tenant, ref, kind, exc) from None
        return self.promise(tenant, rid, self.rt.training.forward(tenant, ref, forward),
                            convert.forward_output)

    @route
    async def optim_step(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        ref = self.op(tenant, body, rid := self._id())
        try:
            adam = convert.adam(body)
        except EngineError as exc:
            raise self.refused(tenant, ref, "optim_step", exc) from None
        # No metrics: the hosted service names none for optim_step, and the cookbook's
        # loops merge these into their own log rows, where our `step` (a float counting
        # from 1) and `learning_rate` overwrote theirs. gRPC's OptimStep keeps them.
        return self.promise(tenant, rid, self.rt.training.optim_step(tenant, ref, adam),
                            lambda _: {"metrics": {}})

    @route
    async def save_weights(self, request: Request) -> Any:
        return await self._save(request, "training")

    @route
    async def save_weights_for_sampler(self, request: Request) -> Any:
        return await self._save(request, "sampler")

    async def _save(self, request: Request, kind: str) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        ref = self.op(tenant, body, rid := self._id())
        name = convert.text(body, "path")
        ephemeral = kind == "sampler" and not name
        try:
            client_kind = convert.text(body, "kind") or "snapshot"
            if client_kind not in ("snapshot", "inflight"):
                raise InvalidArgument(f"kind: {client_kind!r} is not 'snapshot' or 'inflight'")
            if client_kind == "inflight" and not ephemeral:
                raise InvalidArgument("kind: 'inflight' publishes the model's shared sampling "
                                      "weights, never a named checkpoint; drop path")
            if ephemeral and body.get("sampling_session_seq_id") is None:
                raise InvalidArgument("path: give a name, or sampling_session_seq_id for a "
                                      "sampler of the current weights")
            name = name if ephemeral else paths.check_name(name, "path")
            ttl = convert.integer(body, "ttl_seconds")
            check_ttl(ttl)
        except (EngineError, paths.PathError) as exc:
            raise self.refused(tenant, ref, f"save_{kind}", exc) from None
        if ephemeral:
            # Tinker's ephemeral sampler weights: no checkpoint, a snapshot that lives as
            # long as its sampling session (`Sampling.snapshot`); no path, no TTL of its own.
            return self.promise(tenant, rid, self.rt.sampling.snapshot(
                tenant, ref, inflight=client_kind == "inflight"),
                                lambda sampler: {"type": "save_weights_for_sampler",
                                                 "path": None, "sampling_session_id": sampler})
        work = self.rt.training.save(tenant, ref, kind, name,
                                     include_optimizer=kind == "training",
                                     overwrite=bool(body.get("overwrite", False)),
                                     user_metadata=convert.mapping(body, "user_metadata"))
        if ttl is not None:
            work = self._expiring(tenant, work, ttl)
        return self.promise(tenant, rid, work, lambda row: {
            "type": f"save_{'weights' if kind == 'training' else 'weights_for_sampler'}",
            "path": convert.tinker_path(row)})

    async def _expiring(self, tenant: str, saved: Awaitable[CheckpointRow], ttl: int
                        ) -> CheckpointRow:
        """A save, then the expiry the SDK asked for with it (`ttl_seconds`)."""
        row = await saved
        await self.rt.runs.set_checkpoint_ttl(
            tenant, checkpoint_ref(convert.tinker_path(row)), ttl)
        return row

    @route
    async def load_weights(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        text = convert.text(body, "path", required=True)
        optimizer = bool(body.get("optimizer", False))
        rid = self._id()
        if body.get("model_id"):
            ref = self.op(tenant, body, rid)
            try:
                source = checkpoint_ref(text)
            except paths.PathError as exc:
                raise self.refused(tenant, ref, "load_state", exc) from None
            return self.promise(tenant, rid,
                                self.rt.training.load(tenant, ref, source, optimizer),
                                lambda _: {"type": "load_weights", "path": text,
                                           "model_id": body["model_id"]})
        # A new training client from a checkpoint: the SDK names the model itself.
        session_id = convert.text(body, "session_id", required=True)
        alias = f"{session_id}:train:{convert.integer(body, 'model_seq_id', 0)}"
        base_model = convert.text(body, "base_model")
        self.rt.base(base_model)
        source = checkpoint_ref(text)

        async def create() -> str:
            info = await self.rt.training.create_model(
                tenant, spec=None, from_checkpoint=source, load_optimizer=optimizer,
                session_id=session_id, base_model=base_model,
                user_metadata=convert.mapping(body, "user_metadata"))
            self.aliases[(tenant, alias)] = info.entry.model_id
            return info.entry.model_id
        return self.promise(tenant, rid, create(), lambda _: {
            "type": "load_weights", "path": text, "model_id": alias})

    # ------------------------------------------------------------------ sampling

    @route
    async def create_sampling_session(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        text = convert.text(body, "model_path")
        sampler = await self.rt.sampling.create_session(
            tenant, convert.text(body, "session_id"),
            model_path=checkpoint_ref(text, "model_path") if text else None,
            base_model=convert.text(body, "base_model"))
        self.sampler_paths[sampler] = text or None
        return {"type": "create_sampling_session", "sampling_session_id": sampler}

    @route
    async def get_sampler(self, request: Request) -> Any:
        tenant = self.tenant(request)
        sampler = request.path_params["sampler_id"]
        entry = self.rt.sampler_of(tenant, sampler)
        return {"sampler_id": sampler, "base_model": entry.base_model,
                "model_path": self.sampler_paths.get(sampler)}

    @route
    async def asample(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        rid = self._id()
        sampler = convert.text(body, "sampling_session_id")
        if not sampler:
            raise InvalidArgument("sampling_session_id: required; create a sampling client "
                                  "with ServiceClient.create_sampling_client")
        target = self.rt.sampling.target(tenant, None, sampler, rid)
        prompt = convert.prompt_tokens(body)
        params = convert.sampling_params(body)
        num_samples = convert.integer(body, "num_samples", 1) or 1
        include = bool(body.get("prompt_logprobs"))
        topk = convert.integer(body, "topk_prompt_logprobs", 0) or 0
        options = sampling_options.read(body)
        work = self.rt.sampling.sample(target, prompt, num_samples, params, include, topk,
                                       topk_sample_logprobs=options.topk_sample_logprobs,
                                       prompt_options=options.prompt)
        # Fixed at submission (the SDK reads them off the promise); kept, with what
        # stable_reinforce needs, when the request asks to record (`runtime.stability`).
        ids = self.rt.stability.new_ids(num_samples)
        if body.get("record_stability_info"):
            work = self.rt.stability.recorded(tenant, target.queue, prompt, ids, work)
        return self.promise(
            tenant, rid, work,
            lambda result: Response(sampling_options.sample_response(result, include, options),
                                    media_type=convert.PROTOBUF),
            sample_sequence_ids=ids)

    # ------------------------------------------------------------------ futures

    @route
    async def retrieve_future(self, request: Request) -> Any:
        tenant = self.tenant(request)
        body = await json_body(request)
        request_id = convert.text(body, "request_id", required=True)
        entry = self.futures.get(tenant, request_id)
        if not await self.futures.wait(entry):
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
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
        v1 = "/api/v1"
        table = [
            ("GET", "/healthz", self.healthz),
            ("POST", "/client/config", self.client_config),
            ("POST", "/client/dynamic_config", self.dynamic_config),
            ("GET", "/get_server_capabilities", self.capabilities),
            ("POST", "/telemetry", self.telemetry),
            ("POST", "/create_session", self.create_session),
            ("POST", "/session_heartbeat", self.heartbeat),
            ("POST", "/sessions/{session_id}/finish", self.finish_session),
            ("POST", "/create_model", self.create_model),
            ("POST", "/get_info", self.get_info),
            ("POST", "/unload_model", self.unload_model),
            ("POST", "/forward_backward", self.forward_backward),
            ("POST", "/optim_step", self.optim_step),
            ("POST", "/save_weights", self.save_weights),
            ("POST", "/save_weights_for_sampler", self.save_weights_for_sampler),
            ("POST", "/load_weights", self.load_weights),
            ("POST", "/create_sampling_session", self.create_sampling_session),
            ("GET", "/samplers/{sampler_id}", self.get_sampler),
            ("POST", "/asample", self.asample),
            ("POST", "/retrieve_future", self.retrieve_future),
            ("POST", "/cancel_future", self.cancel_future),
        ]
        return [Route(v1 + path, fn, methods=[method]) for method, path, fn in table]
