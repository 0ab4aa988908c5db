"""SamplingService: sampling sessions over a sampler checkpoint, the base, or a live model."""

from __future__ import annotations

import secrets

import numpy as np

from twinkle_client import wire
from twinkle_client._proto.twinkle.v1 import sampling_pb2 as smp
from twinkle_client._proto.twinkle.v1 import sampling_pb2_grpc
from twinkle_server.engine.engine import SampleRequest
from twinkle_server.engine.errors import EngineError
from twinkle_server.engine.sampler import check_topk
from twinkle_server.engine.types import SamplingParams
from twinkle_server.executor import SAMPLE
from twinkle_server.runtime import Runtime, SamplerEntry
from twinkle_server.scheduler import Op
from twinkle_server.service.common import unary
from twinkle_server.service.errors import ServiceError
from twinkle_server.service.training import resolve_checkpoint


def _params(p: smp.SamplingParams, room: int) -> SamplingParams:
    """Engine parameters; max_tokens 0 (Tinker's None) means up to the context limit,
    `room` tokens after the prompt."""
    return SamplingParams(max_tokens=p.max_tokens or max(1, room), temperature=p.temperature,
                          top_p=p.top_p or 1.0, top_k=p.top_k,
                          stop_token_ids=tuple(int(t) for t in p.stop_token_ids),
                          stop_strings=tuple(p.stop_strings),
                          seed=p.seed if p.HasField("seed") else None,
                          stop_on_eos=not p.ignore_eos)


class SamplingServicer(sampling_pb2_grpc.SamplingServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    @unary
    async def CreateSamplingSession(self, request, context):
        rt = self.rt
        tenant = rt.tenant(context)
        chosen = [bool(request.model_path), bool(request.base_model), bool(request.model_id)]
        if sum(chosen) != 1:
            raise ServiceError("invalid_argument", "model_path, base_model, model_id: give "
                                                   "exactly one")
        weights, model_id = None, None
        if request.model_path:
            row, source = resolve_checkpoint(rt, tenant, request.model_path, "model_path")
            weights = str(source)
        elif request.model_id:
            rt.model_of(tenant, request.model_id)
            model_id = request.model_id
        else:
            rt.check_base_model(request.base_model)
        session_id = "samp-" + secrets.token_hex(6)
        rt.samplers[session_id] = SamplerEntry(request.session_id, tenant, model_id, weights,
                                               rt.config.model)
        rt.scheduler.register_model(session_id)
        return smp.SamplingSessionInfo(sampling_session_id=session_id,
                                       base_model=rt.config.model, model_path=request.model_path)

    def _target(self, context, request) -> tuple[str, int | None, str | None, str | None, str]:
        """(queue, seq, adapter_id, weights_path, request_id) for a sample/logprobs request."""
        tenant = self.rt.tenant(context)
        if request.op.model_id:
            self.rt.model_of(tenant, request.op.model_id)
            return request.op.model_id, request.op.seq_id, request.op.model_id, None, \
                request.op.request_id
        entry = self.rt.sampler_of(tenant, request.sampling_session_id)
        return request.sampling_session_id, None, entry.model_id, entry.weights_path, ""

    @unary
    async def Sample(self, request, context):
        queue, seq, adapter_id, weights, request_id = self._target(context, request)
        request_id = request_id or request.request_id
        try:
            prompt = wire.decode_tokens(request.prompt, "prompt").astype(np.int64)
            check_topk(request.topk_prompt_logprobs)  # before sampling, not after it
        except (wire.WireError, EngineError) as exc:
            return await self.rt.run(Op.failed(queue, seq, "sample", exc, request_id))
        payload = SampleRequest(adapter_id, weights, prompt, request.num_samples or 1,
                                _params(request.params,
                                        self.rt.config.max_seq_len - prompt.size))
        tokens = prompt.size * payload.num_samples + payload.params.max_tokens
        sequences = await self.rt.run(Op(queue, seq, "sample", SAMPLE, tokens, payload,
                                         request_id))
        response = smp.SampleResponse()
        for seq_out in sequences:
            response.sequences.append(smp.SampledSequence(
                tokens=wire.encode_array(seq_out.tokens), logprobs=wire.encode_array(
                    seq_out.logprobs), stop_reason=seq_out.stop_reason))
        if request.include_prompt_logprobs or request.topk_prompt_logprobs:
            topk = request.topk_prompt_logprobs
            scored = await self.rt.run(Op(queue, None, "prompt_logprobs", None, prompt.size,
                                          lambda: self.rt.engine.prompt_logprobs(
                                              adapter_id, weights, prompt, topk)))
            if request.include_prompt_logprobs:
                response.prompt_logprobs.CopyFrom(wire.encode_array(scored.logprobs))
            if topk:
                response.topk_prompt_token_ids.CopyFrom(wire.encode_array(scored.topk_token_ids))
                response.topk_prompt_logprobs.CopyFrom(wire.encode_array(scored.topk_logprobs))
        return response

    @unary
    async def ComputeLogprobs(self, request, context):
        queue, seq, adapter_id, weights, request_id = self._target(context, request)
        try:
            prompt = wire.decode_tokens(request.prompt, "prompt").astype(np.int64)
        except wire.WireError as exc:
            return await self.rt.run(Op.failed(queue, seq, "compute_logprobs", exc, request_id))
        lp = await self.rt.run(Op(queue, seq, "compute_logprobs", None, prompt.size,
                                  lambda: self.rt.engine.compute_logprobs(adapter_id, weights,
                                                                          prompt), request_id))
        return smp.ComputeLogprobsResponse(logprobs=wire.encode_array(lp))
