"""SamplingService: sampling sessions, samples and prompt logprobs, as `Call`s (and, for a
live training model, an `OpCall` queued after its earlier ops)."""

from __future__ import annotations

from typing import Any

import numpy as np

from twinkle_client import wire
from twinkle_client._proto.twinkle.v1 import sampling_pb2
from twinkle_client.api.calls import Call, InSession, OpCall, UnaryOp
from twinkle_client.api.values import Completion, SampleResult, SamplingParams, SamplingSession


def _sampling_params(params: SamplingParams) -> sampling_pb2.SamplingParams:
    proto = sampling_pb2.SamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=params.top_k, stop_strings=list(params.stop_strings),
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)
    if params.seed is not None:
        proto.seed = params.seed
    return proto


def _sample_request(prompt: np.ndarray, num_samples: int, params: SamplingParams,
                    field_name: str = "prompt", **fields: Any) -> sampling_pb2.SampleRequest:
    return sampling_pb2.SampleRequest(prompt=wire.encode_array(prompt, field_name),
                                      num_samples=num_samples,
                                      params=_sampling_params(params), **fields)


def _sample_result(reply: sampling_pb2.SampleResponse) -> SampleResult:
    sequences = [Completion(wire.decode_array(seq.tokens, f"sequences[{i}].tokens"),
                            wire.decode_array(seq.logprobs, f"sequences[{i}].logprobs"),
                            seq.stop_reason)
                 for i, seq in enumerate(reply.sequences)]
    prompt_logprobs = topk_ids = topk_logprobs = None
    if reply.HasField("prompt_logprobs"):
        prompt_logprobs = wire.decode_array(reply.prompt_logprobs, "prompt_logprobs")
    if reply.HasField("topk_prompt_token_ids"):
        topk_ids = wire.decode_array(reply.topk_prompt_token_ids, "topk_prompt_token_ids")
        topk_logprobs = wire.decode_array(reply.topk_prompt_logprobs, "topk_prompt_logprobs")
    return SampleResult(sequences, prompt_logprobs, topk_ids, topk_logprobs)


def create_sampling_session(*, model_path: str = "", base_model: str = ""
                            ) -> Call[SamplingSession]:
    """A sampling session under the connection's session: on a sampler checkpoint, or on
    the bare base model."""
    return InSession("sampling", "CreateSamplingSession",
                     sampling_pb2.CreateSamplingSessionRequest(model_path=model_path,
                                                               base_model=base_model),
                     lambda info: SamplingSession(info.sampling_session_id, info.base_model,
                                                  info.model_path), retry=False)


def sample(sampling_session_id: str, prompt: np.ndarray, num_samples: int,
           params: SamplingParams, include_prompt_logprobs: bool = False,
           topk_prompt_logprobs: int = 0) -> Call[SampleResult]:
    """`num_samples` completions of token-id array `prompt` from a sampling session."""
    return Call("sampling", "Sample", _sample_request(
        prompt, num_samples, params, sampling_session_id=sampling_session_id,
        include_prompt_logprobs=include_prompt_logprobs,
        topk_prompt_logprobs=topk_prompt_logprobs), _sample_result)


def compute_logprobs(sampling_session_id: str, prompt: np.ndarray) -> Call[np.ndarray]:
    """The logprob of each prompt token given the ones before it (NaN at position 0)."""
    return Call("sampling", "ComputeLogprobs", sampling_pb2.ComputeLogprobsRequest(
        sampling_session_id=sampling_session_id, prompt=wire.encode_array(prompt, "prompt")),
        lambda reply: wire.decode_array(reply.logprobs, "logprobs"))


def sample_op(prompt: np.ndarray, num_samples: int, params: SamplingParams,
              field_name: str = "prompt") -> OpCall[SampleResult]:
    """A sample from the live adapter, queued after the model's earlier ops."""
    return UnaryOp("sampling", "Sample", _sample_request(prompt, num_samples, params,
                                                         field_name), _sample_result)
