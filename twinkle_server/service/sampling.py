"""SamplingService: proto -> `runtime.sampling` verbs -> proto."""

from __future__ import annotations

import numpy as np

from twinkle_client import wire
from twinkle_client._proto.twinkle.v1 import sampling_pb2 as smp
from twinkle_client._proto.twinkle.v1 import sampling_pb2_grpc
from twinkle_server.engine.types import SamplingParams
from twinkle_server.runtime import Runtime
from twinkle_server.runtime.sampling import Target
from twinkle_server.service.common import checkpoint_ref, op_ref, tenant_of, unary


def params_of(p: smp.SamplingParams) -> SamplingParams:
    """Engine parameters; max_tokens 0 (Tinker's None) means up to the context limit."""
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                          top_p=p.top_p or 1.0, top_k=p.top_k,
                          stop_token_ids=tuple(int(t) for t in p.stop_token_ids),
                          stop_strings=tuple(p.stop_strings),
                          seed=p.seed if p.HasField("seed") else None,
                          stop_on_eos=not p.ignore_eos)


class SamplingServicer(sampling_pb2_grpc.SamplingServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.verbs = rt.sampling

    @unary
    async def CreateSamplingSession(self, request, context):
        tenant = tenant_of(self.rt, context)
        model_path = (checkpoint_ref(request.model_path, "model_path")
                      if request.model_path else None)
        session_id = await self.verbs.create_session(
            tenant, request.session_id, model_path=model_path, base_model=request.base_model,
            model_id=request.model_id)
        return smp.SamplingSessionInfo(sampling_session_id=session_id,
                                       base_model=self.rt.config.model,
                                       model_path=request.model_path)

    def _target(self, context, request) -> Target:
        op = op_ref(request.op) if request.op.model_id else None
        return self.verbs.target(tenant_of(self.rt, context), op, request.sampling_session_id,
                                 getattr(request, "request_id", ""))

    @unary
    async def Sample(self, request, context):
        target = self._target(context, request)
        try:
            prompt = wire.decode_tokens(request.prompt, "prompt").astype(np.int64)
        except wire.WireError as exc:
            return await self.verbs.refuse(target, "sample", exc)
        result = await self.verbs.sample(target, prompt, request.num_samples,
                                         params_of(request.params),
                                         request.include_prompt_logprobs,
                                         request.topk_prompt_logprobs)
        response = smp.SampleResponse()
        for seq_out in result.sequences:
            response.sequences.append(smp.SampledSequence(
                tokens=wire.encode_array(seq_out.tokens), logprobs=wire.encode_array(
                    seq_out.logprobs), stop_reason=seq_out.stop_reason))
        scored = result.prompt_logprobs
        if scored is not None and request.include_prompt_logprobs:
            response.prompt_logprobs.CopyFrom(wire.encode_array(scored.logprobs))
        if scored is not None and request.topk_prompt_logprobs:
            response.topk_prompt_token_ids.CopyFrom(wire.encode_array(scored.topk_token_ids))
            response.topk_prompt_logprobs.CopyFrom(wire.encode_array(scored.topk_logprobs))
        return response

    @unary
    async def ComputeLogprobs(self, request, context):
        target = self._target(context, request)
        try:
            prompt = wire.decode_tokens(request.prompt, "prompt").astype(np.int64)
        except wire.WireError as exc:
            return await self.verbs.refuse(target, "compute_logprobs", exc)
        lp = await self.verbs.compute_logprobs(target, prompt)
        return smp.ComputeLogprobsResponse(logprobs=wire.encode_array(lp))
