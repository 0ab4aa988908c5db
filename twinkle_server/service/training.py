"""TrainingService: models (one adapter each) and every op of a training loop."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np

from twinkle_client import paths, wire
from twinkle_client._proto.twinkle.v1 import common_pb2 as pb
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb
from twinkle_client._proto.twinkle.v1 import training_pb2_grpc
from twinkle_server.engine.engine import ForwardRequest
from twinkle_server.engine.errors import EngineError, InvalidArgument
from twinkle_server.engine.types import AdamParams, Datum, LossSpec
from twinkle_server.executor import FORWARD
from twinkle_server.runtime import ModelEntry, Runtime
from twinkle_server.scheduler import Op
from twinkle_server.service.common import (
    checkpoint_to_proto,
    kwargs_of,
    metadata_of,
    spec_from_proto,
    spec_to_json,
    spec_to_proto,
    streaming,
    unary,
)
from twinkle_server.service.errors import ServiceError
from twinkle_server.store import CheckpointRow


def resolve_checkpoint(rt: Runtime, tenant: str, path: str, field: str = "path"
                       ) -> tuple[CheckpointRow, Path]:
    """A tenant's checkpoint by twinkle:// or tinker:// path; others' look like nothing."""
    ref = paths.parse(path, field)
    row = rt.store.get_checkpoint(tenant, ref.run_id, ref.kind, ref.name)
    if row is None:
        raise ServiceError("not_found", f"{field}: no checkpoint {path!r}")
    return row, rt.store.checkpoint_root / row.rel_path


class TrainingServicer(training_pb2_grpc.TrainingServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    # ------------------------------------------------------------------ models

    def _info(self, entry: ModelEntry) -> tpb.ModelInfo:
        info = self.rt.engine.adapter_info(entry.model_id)
        base = self.rt.engine.base
        return tpb.ModelInfo(
            model_id=entry.model_id, base_model=entry.base_model, arch=base.arch,
            tokenizer_id=entry.base_model, is_lora=True, lora=spec_to_proto(info["spec"]),
            next_seq_id=self.rt.scheduler.next_seq(entry.model_id),
            target_modules=info["target_modules"], trainable_params=info["trainable_params"],
            state_bytes=info["state_bytes"])

    @unary
    async def CreateModel(self, request, context):
        rt = self.rt
        tenant = rt.tenant(context)
        if request.session_id and rt.store.session_tenant(request.session_id) != tenant:
            raise ServiceError("not_found", f"session_id: no session {request.session_id!r}")
        metadata = metadata_of(request.user_metadata, "user_metadata")
        base_name = request.base_model or rt.config.model
        rt.check_base_model(base_name)
        owned = sum(1 for e in rt.models.values() if e.tenant == tenant)
        if owned >= rt.config.max_adapters_per_tenant:
            raise ServiceError("resource_exhausted",
                               f"adapters: tenant already has {owned} adapters loaded, the "
                               f"per-tenant limit (--max-adapters-per-tenant "
                               f"{rt.config.max_adapters_per_tenant}); unload one first")
        source = None
        if request.from_checkpoint:
            _, source = resolve_checkpoint(rt, tenant, request.from_checkpoint,
                                           "from_checkpoint")
            spec = rt.engine.read_checkpoint_spec(source)
        else:
            spec = spec_from_proto(request.lora)
        accum = request.gradient_accumulation_steps or 1
        model_id = rt.new_model_id()

        def create() -> None:
            rt.engine.add_adapter(model_id, spec, gradient_accumulation_steps=accum)
            if source is not None:
                try:
                    rt.engine.load_state(model_id, source, include_optimizer=request.load_optimizer,
                                         adopt_accumulation=not request.gradient_accumulation_steps)
                except EngineError:
                    rt.engine.remove_adapter(model_id)
                    raise
        await rt.admin("create_model", create)
        entry = ModelEntry(model_id, tenant, request.session_id or None, base_name)
        rt.models[model_id] = entry
        rt.scheduler.register_model(model_id)
        rt.store.create_run(model_id, tenant, base_name,
                            spec_to_json(rt.engine.adapters[model_id].spec),
                            metadata, request.session_id or None)
        return self._info(entry)

    @unary
    async def GetInfo(self, request, context):
        entry = self.rt.model_of(self.rt.tenant(context), request.model_id)
        return self._info(entry)

    @unary
    async def UnloadModel(self, request, context):
        self.rt.model_of(self.rt.tenant(context), request.model_id)
        await self.rt.unload(request.model_id, "unloaded by its owner")
        return pb.Empty()

    # ------------------------------------------------------------------ ordered ops

    async def _op(self, context, header: pb.OpHeader, kind: str, fn: Callable[[], Any],
                  prepare: Callable[[], Any] | None = None) -> Any:
        """Run `fn` as the model's op `header.seq_id`.

        `prepare` does the request's own checks; if it fails, the failure is stored as
        this seq's result, so the model's later ops are not left waiting for it.
        """
        tenant = self.rt.tenant(context)
        self.rt.model_of(tenant, header.model_id)
        self.rt.store.touch_run(header.model_id)
        op = Op(header.model_id, header.seq_id, kind, None, 0, fn, header.request_id)
        if prepare is not None:
            try:
                prepare()
            except Exception as exc:
                op = Op.failed(header.model_id, header.seq_id, kind, exc, header.request_id)
        return await self.rt.run(op)

    async def _read_forward(self, request_iterator, context, backward: bool
                            ) -> tuple[pb.OpHeader, Op]:
        """Read every chunk, decode and validate; returns the op to run (or a failing op)."""
        rt = self.rt
        header = None
        datums: list[Datum] = []
        tokens = 0
        error: Exception | None = None
        async for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    raise ServiceError("invalid_argument", "header: the first chunk must carry "
                                                           "the ForwardHeader")
                header = chunk.header
                tenant = rt.tenant(context)
                rt.model_of(tenant, header.op.model_id)
                if header.num_datums < 0:
                    error = InvalidArgument(f"num_datums: must not be negative, got "
                                            f"{header.num_datums}")
                elif header.num_datums > rt.config.max_batch_tokens:
                    error = InvalidArgument(
                        f"num_datums: {header.num_datums} datums need more than the "
                        f"{rt.config.max_batch_tokens} tokens one request may hold "
                        "(--max-batch-tokens); split the batch")
            if error is not None:
                continue
            arrived = len(datums) + len(chunk.batch.lengths)
            if arrived > header.num_datums:
                # Refused before unpacking: a chunk of empty datums costs nothing to send
                # and one Python object each to unpack.
                error = InvalidArgument(f"num_datums: header says {header.num_datums} but "
                                        f"{arrived} datums arrived")
                continue
            try:
                unpacked = wire.unpack_datums(chunk.batch, len(datums))
                tokens += sum(datum.num_tokens for datum in unpacked)
                if tokens > rt.config.max_batch_tokens:
                    raise InvalidArgument(
                        f"data: more than {rt.config.max_batch_tokens} tokens in one request "
                        "(--max-batch-tokens); split the batch")
                datums.extend(unpacked)
            except (wire.WireError, EngineError) as exc:
                error = exc
        if header is None:
            raise ServiceError("invalid_argument", "data: the stream carried no chunks")
        if error is None and len(datums) < header.num_datums:
            # A stream cut short (its client gone, or a bug): nothing runs and the seq_id
            # stays free, so a retry of the whole op under the same seq_id still applies.
            raise ServiceError("invalid_argument", f"num_datums: header says "
                                                   f"{header.num_datums} but {len(datums)} "
                                                   "datums arrived; the op did not run")
        loss = LossSpec(header.loss.name, dict(header.loss.config)) if header.loss.name else None
        request = ForwardRequest(header.op.model_id, datums, loss, backward)
        if error is None:
            try:
                rt.engine.check_forward(request)  # the adapter's own checks run in its op
            except EngineError as exc:
                error = exc
        kind = "forward_backward" if backward else "forward"
        if error is not None:
            return header.op, Op.failed(header.op.model_id, header.op.seq_id, kind, error,
                                        header.op.request_id)
        return header.op, Op(header.op.model_id, header.op.seq_id, kind, FORWARD, tokens,
                             request, header.op.request_id)

    async def _forward(self, request_iterator, context, backward: bool
                       ) -> AsyncIterator[tpb.ForwardResultChunk]:
        op_header, op = await self._read_forward(request_iterator, context, backward)
        self.rt.store.touch_run(op_header.model_id)
        result = await self.rt.run(op)
        chunk = tpb.ForwardResultChunk()
        size = 0
        for lp in result.logprobs:
            out = tpb.DatumOutput()
            out.outputs["logprobs"].CopyFrom(wire.encode_array(lp, "logprobs"))
            need = out.ByteSize() + 16
            if chunk.outputs and size + need > wire.DEFAULT_CHUNK_BYTES:
                yield chunk
                chunk, size = tpb.ForwardResultChunk(), 0
            chunk.outputs.append(out)
            size += need
        chunk.done = True
        chunk.loss = result.loss
        chunk.metrics.update(result.metrics)
        yield chunk

    @streaming
    async def Forward(self, request_iterator, context):
        async for chunk in self._forward(request_iterator, context, backward=False):
            yield chunk

    @streaming
    async def ForwardBackward(self, request_iterator, context):
        async for chunk in self._forward(request_iterator, context, backward=True):
            yield chunk

    @unary
    async def OptimStep(self, request, context):
        a = request.adam
        adam = AdamParams(learning_rate=a.learning_rate, beta1=a.beta1, beta2=a.beta2,
                          eps=a.eps, weight_decay=a.weight_decay, grad_clip_norm=a.grad_clip_norm)
        mid = request.op.model_id
        metrics = await self._op(context, request.op, "optim_step",
                                 lambda: self.rt.engine.optim_step(mid, adam))
        return tpb.MetricsResponse(metrics=metrics)

    @unary
    async def SetOptimizer(self, request, context):
        kwargs, mid = kwargs_of(request.kwargs), request.op.model_id
        await self._op(context, request.op, "set_optimizer",
                       lambda: self.rt.engine.set_optimizer(mid, request.name, kwargs))
        return tpb.OpResponse()

    @unary
    async def SetLrScheduler(self, request, context):
        kwargs, mid = kwargs_of(request.kwargs), request.op.model_id
        await self._op(context, request.op, "set_lr_scheduler",
                       lambda: self.rt.engine.set_lr_scheduler(mid, request.name, kwargs))
        return tpb.OpResponse()

    @unary
    async def SetLoss(self, request, context):
        loss, mid = LossSpec(request.loss.name, dict(request.loss.config)), request.op.model_id
        await self._op(context, request.op, "set_loss",
                       lambda: self.rt.engine.set_loss(mid, loss))
        return tpb.OpResponse()

    @unary
    async def ClipGradNorm(self, request, context):
        mid = request.op.model_id
        norm = await self._op(context, request.op, "clip_grad_norm",
                              lambda: self.rt.engine.clip_grad_norm(mid, request.max_norm))
        return tpb.MetricsResponse(metrics={"grad_norm": norm})

    @unary
    async def Step(self, request, context):
        mid = request.op.model_id
        metrics = await self._op(context, request.op, "step", lambda: self.rt.engine.step(mid))
        return tpb.MetricsResponse(metrics=metrics)

    @unary
    async def ZeroGrad(self, request, context):
        mid = request.op.model_id
        await self._op(context, request.op, "zero_grad", lambda: self.rt.engine.zero_grad(mid))
        return tpb.OpResponse()

    @unary
    async def LrStep(self, request, context):
        mid = request.op.model_id
        await self._op(context, request.op, "lr_step", lambda: self.rt.engine.lr_step(mid))
        return tpb.OpResponse()

    @unary
    async def CalculateMetric(self, request, context):
        mid = request.op.model_id
        metrics = await self._op(
            context, request.op, "calculate_metric",
            lambda: self.rt.engine.calculate_metric(mid, request.is_training))
        return tpb.MetricsResponse(metrics={k: float(v) for k, v in metrics.items()
                                            if np.isfinite(v)})

    @unary
    async def GetTrainConfigs(self, request, context):
        mid = request.op.model_id
        configs = await self._op(context, request.op, "get_train_configs",
                                 lambda: self.rt.engine.get_train_configs(mid))
        return tpb.TrainConfigs(json=json.dumps(configs, default=str))

    @unary
    async def SkipSeq(self, request, context):
        await self._op(context, request.op, "skip_seq", lambda: None)
        return tpb.OpResponse()

    # ------------------------------------------------------------------ checkpoints

    async def _save(self, request, context, kind: str) -> tpb.SaveResponse:
        rt = self.rt
        tenant = rt.tenant(context)
        mid = request.op.model_id
        target = rt.store.checkpoint_dir(tenant, mid, kind, "_")
        with_optimizer = kind == "training" and request.include_optimizer
        metadata: dict[str, str] = {}

        def check() -> None:
            nonlocal target, metadata
            target = rt.store.checkpoint_dir(tenant, mid, kind, paths.check_name(request.name))
            metadata = metadata_of(request.user_metadata, "user_metadata")

        def save() -> CheckpointRow:
            if kind == "sampler":
                size = rt.engine.save_weights(mid, target, overwrite=request.overwrite)
            else:
                size = rt.engine.save_state(mid, target, include_optimizer=with_optimizer,
                                            overwrite=request.overwrite)
            # Recorded inside the op, so the model's next op (a pipelined load of this
            # name) finds it.
            row = CheckpointRow(mid, kind, request.name, tenant,
                                str(target.relative_to(rt.store.checkpoint_root)), size,
                                with_optimizer, time.time(), metadata)
            rt.store.add_checkpoint(row)
            return row

        row = await self._op(context, request.op, f"save_{kind}", save, prepare=check)
        proto = checkpoint_to_proto(row, rt.store.get_run(tenant, mid))
        return tpb.SaveResponse(path=proto.path, checkpoint=proto)

    @unary
    async def SaveState(self, request, context):
        return await self._save(request, context, "training")

    @unary
    async def SaveWeightsForSampler(self, request, context):
        return await self._save(request, context, "sampler")

    @unary
    async def LoadState(self, request, context):
        tenant = self.rt.tenant(context)
        mid = request.op.model_id

        def load() -> None:
            # Resolved in the op: a save queued before this load has recorded its path.
            _, source = resolve_checkpoint(self.rt, tenant, request.path)
            self.rt.engine.load_state(mid, source, request.include_optimizer)

        await self._op(context, request.op, "load_state", load)
        return tpb.OpResponse()
