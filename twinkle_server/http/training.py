"""The Tinker REST routes of training: models (create, info, unload, load from a
checkpoint) and their ordered ops (forward_backward, optim_step, saves), each answered at
once with a future (`Front.promise`); a refused op takes its seq_id (`Front.refused`)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from twinkle_server.engine.errors import EngineError, InvalidArgument
from twinkle_server.engine.types import LoraSpec
from twinkle_server.http import convert
from twinkle_server.http.app import API_PREFIX, Front, json_body, read_body, route
from twinkle_server.http.errors import BadBody
from twinkle_server.runtime import checkpoint_ref
from twinkle_server.runtime.runs import check_ttl
from twinkle_server.store import CheckpointRow
from twinkle_wire import paths


class TrainingRoutes:
    """The SDK's `TrainingClient` routes over the front's auth, aliases and futures."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.rt = front.rt

    # ------------------------------------------------------------------ models

    @route
    async def create_model(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        lora = convert._field(body, "lora_config", dict, required=True)
        optimizer = convert._field(body, "optimizer_config", dict, {})
        if optimizer.get("type", "adamw") != "adamw":
            raise InvalidArgument(f"optimizer_config.type: {optimizer.get('type')!r}; this "
                                  "server runs AdamW only")
        base_model = convert.text(body, "base_model")
        self.rt.base(base_model).check_trains()
        spec = LoraSpec.from_tinker(
            convert.integer(lora, "rank", 32), convert.seed(lora, "seed", "lora_config.seed"),
            *(convert.flag(lora, part, True, f"lora_config.{part}")
              for part in ("train_mlp", "train_attn", "train_unembed")))
        session_id = convert.text(body, "session_id")
        work = self.rt.training.create_model(
            tenant, spec=spec, session_id=session_id, base_model=base_model,
            user_metadata=convert.mapping(body, "user_metadata"))
        return await self.front.promise(tenant, self.front._id(), work, lambda info: {
            "type": "create_model", "model_id": info.entry.model_id})

    @route
    async def get_info(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        sdk_id = convert.text(body, "model_id", required=True)
        info = self.rt.training.info(tenant, self.front.model(tenant, sdk_id))
        return {"type": "get_info", "model_id": sdk_id, "is_lora": True,
                "lora_rank": info.spec.rank, "model_name": info.entry.base_model,
                "model_data": {"arch": info.arch, "model_name": info.entry.base_model,
                               "tokenizer_id": info.tokenizer_id}}

    @route
    async def unload_model(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        sdk_id = convert.text(body, "model_id", required=True)
        work = self.rt.training.unload_model(tenant, self.front.model(tenant, sdk_id))
        return await self.front.promise(tenant, self.front._id(), work,
                            lambda _: {"type": "unload_model", "model_id": sdk_id})

    # ------------------------------------------------------------------ training ops

    @route
    async def forward_backward(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        if request.headers.get("content-encoding", "identity") != "identity":
            raise BadBody("content-encoding: send the body uncompressed (the server's "
                          "client/config sets proto_compress_fwdbwd false)")
        msg, datums, loss = convert.forward_request(
            await read_body(request), lambda sdk_id, total: self.rt.training.check_tokens(
                self.front.aliases.get((tenant, sdk_id), sdk_id), total))
        ref = self.front.op_ref(tenant, msg.model_id, msg.seq_id, rid := self.front._id())
        backward = not msg.forward_only
        kind = "forward_backward" if backward else "forward"
        try:
            if isinstance(datums, Exception):
                raise datums
            forward = self.rt.training.forward_request(tenant, ref.model_id, datums, loss,
                                                       backward, convert.provenance(msg))
        except (EngineError, ValueError) as exc:
            # Answered with a future that fails in the op's turn, not a 400 at once: the
            # SDK sends a parallel forward_backward's first chunk only once the others
            # are answered, so a later chunk's 400 left the first unsent and the model's
            # queue waiting for it, with every op after it, for good.
            refusal = self.rt.training.refuse(tenant, ref, kind, exc)
            self.front.futures.submit(tenant, rid, refusal.outcome, convert.forward_output)
            return {"request_id": rid}
        return await self.front.promise(tenant, rid,
                                        self.rt.training.forward(tenant, ref, forward),
                                        convert.forward_output)

    @route
    async def optim_step(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        ref = self.front.op(tenant, body, rid := self.front._id())
        try:
            adam = convert.adam(body)
        except EngineError as exc:
            raise self.front.refused(tenant, ref, "optim_step", exc) from None
        # The gradient norm only: the cookbook's loops merge these metrics into their own
        # log rows, where our `step` (a float counting from 1) and `learning_rate` would
        # overwrite theirs; no loop of theirs names `grad_norm`. gRPC's OptimStep keeps all.
        return await self.front.promise(tenant, rid,
                                        self.rt.training.optim_step(tenant, ref, adam),
                                        lambda metrics: {"metrics": {
                                            "grad_norm": metrics["grad_norm"]}})

    @route
    async def save_weights(self, request: Request) -> Any:
        return await self._save(request, "training")

    @route
    async def save_weights_for_sampler(self, request: Request) -> Any:
        return await self._save(request, "sampler")

    async def _save(self, request: Request, kind: str) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        ref = self.front.op(tenant, body, rid := self.front._id())
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
            overwrite = convert.flag(body, "overwrite")
        except (EngineError, paths.PathError) as exc:
            raise self.front.refused(tenant, ref, f"save_{kind}", exc) from None
        if ephemeral:
            # Tinker's ephemeral sampler weights: no checkpoint, a snapshot that lives as
            # long as its sampling session (`Sampling.snapshot`); no path, no TTL of its own.
            return await self.front.promise(tenant, rid, self.rt.sampling.snapshot(
                tenant, ref, inflight=client_kind == "inflight"),
                                lambda sampler: {"type": "save_weights_for_sampler",
                                                 "path": None, "sampling_session_id": sampler})
        work = self.rt.training.save(tenant, ref, kind, name,
                                     include_optimizer=kind == "training",
                                     overwrite=overwrite,
                                     user_metadata=convert.mapping(body, "user_metadata"))
        if ttl is not None:
            work = self._expiring(tenant, work, ttl)
        return await self.front.promise(tenant, rid, work, lambda row: {
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
        tenant = self.front.tenant(request)
        body = await json_body(request)
        text = convert.text(body, "path", required=True)
        rid = self.front._id()
        if body.get("model_id"):
            ref = self.front.op(tenant, body, rid)
            try:
                source = checkpoint_ref(text)
                optimizer = convert.flag(body, "optimizer")
            except (EngineError, paths.PathError) as exc:
                raise self.front.refused(tenant, ref, "load_state", exc) from None
            return await self.front.promise(tenant, rid,
                                self.rt.training.load(tenant, ref, source, optimizer),
                                lambda _: {"type": "load_weights", "path": text,
                                           "model_id": body["model_id"]})
        # A new training client from a checkpoint: the SDK names the model itself.
        session_id = convert.text(body, "session_id", required=True)
        optimizer = convert.flag(body, "optimizer")
        alias = f"{session_id}:train:{convert.integer(body, 'model_seq_id', 0)}"
        base_model = convert.text(body, "base_model")
        self.rt.base(base_model)
        source = checkpoint_ref(text)

        async def create() -> str:
            info = await self.rt.training.create_model(
                tenant, spec=None, from_checkpoint=source, load_optimizer=optimizer,
                session_id=session_id, base_model=base_model,
                user_metadata=convert.mapping(body, "user_metadata"))
            self.front.alias(tenant, alias, info.entry.model_id)
            return info.entry.model_id
        return await self.front.promise(tenant, rid, create(), lambda _: {
            "type": "load_weights", "path": text, "model_id": alias})

    def routes(self) -> list[Route]:
        table = [
            ("POST", "/create_model", self.create_model),
            ("POST", "/get_info", self.get_info),
            ("POST", "/unload_model", self.unload_model),
            ("POST", "/delete_model", self.unload_model),   # other Tinker tools' name
            ("POST", "/forward_backward", self.forward_backward),
            ("POST", "/optim_step", self.optim_step),
            ("POST", "/save_weights", self.save_weights),
            ("POST", "/save_weights_for_sampler", self.save_weights_for_sampler),
            ("POST", "/load_weights", self.load_weights),
        ]
        return [Route(API_PREFIX + path, fn, methods=[method]) for method, path, fn in table]
