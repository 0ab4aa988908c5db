"""TrainingService: proto -> `runtime.training` verbs -> proto."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import numpy as np

import twinkle_wire as wire
from twinkle_server.engine.errors import EngineError, InvalidArgument
from twinkle_server.engine.types import AdamParams, Datum, ForwardRequest, LossSpec
from twinkle_server.runtime import Runtime, checkpoint_ref
from twinkle_server.runtime.training import ModelInfo
from twinkle_server.service.common import (
    checkpoint_to_proto,
    kwargs_of,
    op_ref,
    spec_from_proto,
    spec_to_proto,
    streaming,
    tenant_of,
    unary,
)
from twinkle_wire import paths
from twinkle_wire._proto.twinkle.v1 import common_pb2 as pb
from twinkle_wire._proto.twinkle.v1 import training_pb2 as tpb
from twinkle_wire._proto.twinkle.v1 import training_pb2_grpc


def info_to_proto(info: ModelInfo) -> tpb.ModelInfo:
    return tpb.ModelInfo(
        model_id=info.entry.model_id, base_model=info.entry.base_model, arch=info.arch,
        tokenizer_id=info.tokenizer_id, is_lora=True, lora=spec_to_proto(info.spec),
        next_seq_id=info.next_seq_id, target_modules=info.target_modules,
        trainable_params=info.trainable_params, state_bytes=info.state_bytes)


def loss_of(loss: pb.LossFn) -> LossSpec | None:
    return LossSpec(loss.name, dict(loss.config)) if loss.name else None


class TrainingServicer(training_pb2_grpc.TrainingServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.verbs = rt.training

    # ------------------------------------------------------------------ models

    @unary
    async def CreateModel(self, request, context):
        tenant = tenant_of(self.rt, context)
        source = (checkpoint_ref(request.from_checkpoint, "from_checkpoint")
                  if request.from_checkpoint else None)
        info = await self.verbs.create_model(
            tenant, spec=None if source else spec_from_proto(request.lora),
            from_checkpoint=source, load_optimizer=request.load_optimizer,
            session_id=request.session_id, base_model=request.base_model,
            user_metadata=request.user_metadata,
            gradient_accumulation_steps=request.gradient_accumulation_steps)
        return info_to_proto(info)

    @unary
    async def GetInfo(self, request, context):
        return info_to_proto(self.verbs.info(tenant_of(self.rt, context), request.model_id))

    @unary
    async def UnloadModel(self, request, context):
        await self.verbs.unload_model(tenant_of(self.rt, context), request.model_id)
        return pb.Empty()

    # ------------------------------------------------------------------ forward

    async def _read_forward(self, request_iterator, context, backward: bool):
        """Read every chunk and decode it; returns (tenant, header, request or refusal).

        A refusal found while reading (a bad chunk, too many datums or tokens) still
        reads the stream to its end, then takes the op's seq_id as its result.
        """
        tenant = header = None
        datums: list[Datum] = []
        provenance: list[wire.Provenance | None] = []
        tokens = 0
        error: Exception | None = None
        async for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    raise InvalidArgument("header: the first chunk must carry the "
                                          "ForwardHeader")
                header = chunk.header
                tenant = tenant_of(self.rt, context)
                self.rt.model_of(tenant, header.op.model_id)
                if header.num_datums < 0:
                    error = InvalidArgument(f"num_datums: must not be negative, got "
                                            f"{header.num_datums}")
                elif header.num_datums > (limit := self.rt.base_of(
                        header.op.model_id).model.max_batch_tokens):
                    error = InvalidArgument(
                        f"num_datums: {header.num_datums} datums need more than the "
                        f"{limit} tokens one request may hold "
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
                provenance.extend(wire.read_provenance(chunk, len(datums)))
                unpacked = wire.unpack_datums(chunk.batch, len(datums))
                tokens += sum(datum.num_tokens for datum in unpacked)
                self.verbs.check_tokens(header.op.model_id, tokens)
                datums.extend(unpacked)
            except (wire.WireError, EngineError) as exc:
                error = exc
        if header is None:
            raise InvalidArgument("data: the stream carried no chunks")
        if error is None and len(datums) < header.num_datums:
            # A stream cut short (its client gone, or a bug): nothing runs and the seq_id
            # stays free, so a retry of the whole op under the same seq_id still applies.
            raise InvalidArgument(f"num_datums: header says {header.num_datums} but "
                                  f"{len(datums)} datums arrived; the op did not run")
        if error is None:
            try:
                return tenant, header, self.verbs.forward_request(
                    tenant, header.op.model_id, datums, loss_of(header.loss), backward,
                    provenance)
            except EngineError as exc:
                error = exc
        return tenant, header, error

    async def _forward(self, request_iterator, context, backward: bool
                       ) -> AsyncIterator[tpb.ForwardResultChunk]:
        tenant, header, request = await self._read_forward(request_iterator, context,
                                                           backward)
        ref = op_ref(header.op)
        if isinstance(request, ForwardRequest):
            result = await self.verbs.forward(tenant, ref, request)
        else:  # a retry of a seq_id that already ran gets that run's result instead
            result = await self.verbs.refuse(
                tenant, ref, "forward_backward" if backward else "forward", request)
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

    # ------------------------------------------------------------------ optimizer and loop

    @unary
    async def OptimStep(self, request, context):
        a = request.adam
        adam = AdamParams(learning_rate=a.learning_rate, beta1=a.beta1, beta2=a.beta2,
                          eps=a.eps, weight_decay=a.weight_decay, grad_clip_norm=a.grad_clip_norm)
        metrics = await self.verbs.optim_step(tenant_of(self.rt, context), op_ref(request.op),
                                              adam)
        return tpb.MetricsResponse(metrics=metrics)

    @unary
    async def SetOptimizer(self, request, context):
        await self.verbs.set_optimizer(tenant_of(self.rt, context), op_ref(request.op),
                                       request.name, kwargs_of(request.kwargs))
        return tpb.OpResponse()

    @unary
    async def SetLrScheduler(self, request, context):
        await self.verbs.set_lr_scheduler(tenant_of(self.rt, context), op_ref(request.op),
                                          request.name, kwargs_of(request.kwargs))
        return tpb.OpResponse()

    @unary
    async def SetLoss(self, request, context):
        await self.verbs.set_loss(tenant_of(self.rt, context), op_ref(request.op),
                                  LossSpec(request.loss.name, dict(request.loss.config)))
        return tpb.OpResponse()

    @unary
    async def ClipGradNorm(self, request, context):
        norm = await self.verbs.clip_grad_norm(tenant_of(self.rt, context), op_ref(request.op),
                                               request.max_norm)
        return tpb.MetricsResponse(metrics={"grad_norm": norm})

    @unary
    async def Step(self, request, context):
        metrics = await self.verbs.step(tenant_of(self.rt, context), op_ref(request.op))
        return tpb.MetricsResponse(metrics=metrics)

    @unary
    async def ZeroGrad(self, request, context):
        await self.verbs.zero_grad(tenant_of(self.rt, context), op_ref(request.op))
        return tpb.OpResponse()

    @unary
    async def LrStep(self, request, context):
        await self.verbs.lr_step(tenant_of(self.rt, context), op_ref(request.op))
        return tpb.OpResponse()

    @unary
    async def CalculateMetric(self, request, context):
        metrics = await self.verbs.calculate_metric(tenant_of(self.rt, context),
                                                    op_ref(request.op), request.is_training)
        return tpb.MetricsResponse(metrics={k: float(v) for k, v in metrics.items()
                                            if np.isfinite(v)})

    @unary
    async def GetTrainConfigs(self, request, context):
        configs = await self.verbs.get_train_configs(tenant_of(self.rt, context),
                                                     op_ref(request.op))
        return tpb.TrainConfigs(json=json.dumps(configs, default=str))

    @unary
    async def SkipSeq(self, request, context):
        await self.verbs.skip_seq(tenant_of(self.rt, context), op_ref(request.op))
        return tpb.OpResponse()

    # ------------------------------------------------------------------ checkpoints

    async def _save(self, request, context, kind: str) -> tpb.SaveResponse:
        tenant = tenant_of(self.rt, context)
        ref = op_ref(request.op)
        try:
            name = paths.check_name(request.name)
        except paths.PathError as exc:
            row = await self.verbs.refuse(tenant, ref, f"save_{kind}", exc)
        else:
            row = await self.verbs.save(tenant, ref, kind, name,
                                        include_optimizer=request.include_optimizer,
                                        overwrite=request.overwrite,
                                        user_metadata=request.user_metadata)
        proto = checkpoint_to_proto(row, self.rt.runs.run_of(row))
        return tpb.SaveResponse(path=proto.path, checkpoint=proto)

    @unary
    async def SaveState(self, request, context):
        return await self._save(request, context, "training")

    @unary
    async def SaveWeightsForSampler(self, request, context):
        if not request.ephemeral and not request.inflight:
            return await self._save(request, context, "sampler")
        # Tinker's ephemeral sampler weights: a sampling session on a snapshot of its own
        # (`Sampling.snapshot`), no checkpoint.
        tenant = tenant_of(self.rt, context)
        ref = op_ref(request.op)
        if request.name:
            await self.verbs.refuse(tenant, ref, "save_sampler", InvalidArgument(
                f"name: {request.name!r} with ephemeral; ephemeral weights have no name "
                "(save a named sampler checkpoint without ephemeral)"))
        if not request.ephemeral:
            await self.verbs.refuse(tenant, ref, "save_sampler", InvalidArgument(
                "inflight: needs ephemeral; inflight weights are a shared target, not a "
                "checkpoint"))
        sampler = await self.rt.sampling.snapshot(tenant, ref, inflight=request.inflight)
        return tpb.SaveResponse(sampling_session_id=sampler)

    @unary
    async def LoadState(self, request, context):
        tenant = tenant_of(self.rt, context)
        ref = op_ref(request.op)
        try:
            source = checkpoint_ref(request.path)
        except paths.PathError as exc:
            await self.verbs.refuse(tenant, ref, "load_state", exc)
        else:
            await self.verbs.load(tenant, ref, source, request.include_optimizer)
        return tpb.OpResponse()
