"""SamplingService: proto -> `runtime.sampling` verbs -> proto."""

from __future__ import annotations

import numpy as np

import twinkle_wire as wire
from twinkle_server.engine import PromptScoring
from twinkle_server.engine.types import SamplingParams
from twinkle_server.runtime import Runtime, checkpoint_ref
from twinkle_server.runtime.sampling import Target
from twinkle_server.service.common import op_ref, tenant_of, unary
from twinkle_wire._proto.twinkle.v1 import sampling_pb2 as smp
from twinkle_wire._proto.twinkle.v1 import sampling_pb2_grpc


def params_of(p: smp.SamplingParams) -> SamplingParams:
    """Engine parameters; max_tokens 0 (Tinker's None) means up to the context limit, a
    top_p left out is 1.0 (a top_p of 0 is the engine's to refuse)."""
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature,
                          top_p=p.top_p if p.HasField("top_p") else 1.0, top_k=p.top_k,
                          stop_token_ids=tuple(int(t) for t in p.stop_token_ids),
                          stop_strings=tuple(p.stop_strings),
                          seed=p.seed if p.HasField("seed") else None,
                          ignore_eos=p.ignore_eos)


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
        base_model = self.rt.sampler_of(tenant, session_id).base_model
        return smp.SamplingSessionInfo(sampling_session_id=session_id, base_model=base_model,
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
            options = prompt_options(request)
        except wire.WireError as exc:
            return await self.verbs.refuse(target, "sample", exc)
        result = await self.verbs.sample(target, prompt, request.num_samples
                                         if request.HasField("num_samples") else 1,
                                         params_of(request.params),
                                         request.include_prompt_logprobs,
                                         request.topk_prompt_logprobs,
                                         topk_sample_logprobs=request.topk_sample_logprobs,
                                         prompt_options=options)
        ids = self.rt.stability.new_ids(len(result.sequences))
        if request.record_stability_info:
            await self.rt.stability.record(tenant_of(self.rt, context), target.queue, prompt,
                                           ids, result)
        response = smp.SampleResponse(prompt_cache_hit_tokens=result.prompt_cache_hit_tokens)
        for seq_out, sequence_id in zip(result.sequences, ids, strict=True):
            response.sequences.append(smp.SampledSequence(
                sequence_id=sequence_id,
                tokens=wire.encode_array(seq_out.tokens), logprobs=wire.encode_array(
                    seq_out.logprobs), stop_reason=seq_out.stop_reason))
        scored = result.prompt_logprobs
        if scored is not None and request.include_prompt_logprobs:
            response.prompt_logprobs.CopyFrom(wire.encode_array(scored.logprobs))
        if scored is not None and request.topk_prompt_logprobs:
            response.topk_prompt_token_ids.CopyFrom(wire.encode_array(scored.topk_token_ids))
            response.topk_prompt_logprobs.CopyFrom(wire.encode_array(scored.topk_logprobs))
        add_sampling_options(response, result)
        return response

    @unary
    async def ComputeLogprobs(self, request, context):
        target = self._target(context, request)
        try:
            prompt = wire.decode_tokens(request.prompt, "prompt").astype(np.int64)
        except wire.WireError as exc:
            return await self.verbs.refuse(target, "compute_logprobs", exc)
        lp = await self.verbs.compute_logprobs(target, prompt,
                                               request.prompt_logprobs_last_n or None)
        return smp.ComputeLogprobsResponse(logprobs=wire.encode_array(lp))


def prompt_options(request: smp.SampleRequest) -> PromptScoring:
    """The request's Tinker prompt options (fields 20+); `runtime.sampling` checks them."""
    targets = None
    if request.HasField("target_prompt_logprobs"):
        targets = wire.decode_array(request.target_prompt_logprobs, "target_prompt_logprobs")
        if targets.dtype.kind != "i":
            raise wire.WireError(f"target_prompt_logprobs: must hold integer token ids, got "
                                 f"{targets.dtype}")
        targets = targets.astype(np.int64)
    return PromptScoring(last_n=request.prompt_logprobs_last_n or None, targets=targets,
                         alt_k=request.prompt_alt_tokens_k)


def add_sampling_options(response: smp.SampleResponse, result) -> None:
    """Fill what the request's Tinker options asked for (each is None when not asked):
    per-sequence top-k, target prompt logprobs, alternative prompt tokens."""
    for seq_msg, seq_out in zip(response.sequences, result.sequences, strict=True):
        if seq_out.topk_token_ids is not None:
            seq_msg.topk_token_ids.CopyFrom(wire.encode_array(seq_out.topk_token_ids))
            seq_msg.topk_logprobs.CopyFrom(wire.encode_array(seq_out.topk_logprobs))
    scored = result.prompt_logprobs
    if scored is None:
        return
    if scored.target_logprobs is not None:
        response.target_prompt_logprobs.CopyFrom(wire.encode_array(scored.target_logprobs))
    if scored.alt_tokens is not None:
        response.prompt_alt_tokens.CopyFrom(wire.encode_array(scored.alt_tokens))
        response.prompt_alt_logprobs.CopyFrom(wire.encode_array(scored.alt_logprobs))
