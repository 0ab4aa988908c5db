"""SamplingService: sampling sessions, samples and prompt logprobs, as `Call`s (and, for a
live training model, an `OpCall` queued after its earlier ops)."""

from __future__ import annotations

from typing import Any

import numpy as np

import twinkle_wire as wire
from twinkle_client.api.calls import Call, InSession, OpCall, UnaryOp
from twinkle_client.api.values import Completion, SampleResult, SamplingSession
from twinkle_wire._proto.twinkle.v1 import sampling_pb2
from twinkle_wire.values import SamplingParams


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


def _optional(message: Any, name: str, field: str) -> np.ndarray | None:
    """`message.<name>` decoded, or None when the reply left it unset."""
    return wire.decode_array(getattr(message, name), field) if message.HasField(name) else None


def _sample_result(reply: sampling_pb2.SampleResponse) -> SampleResult:
    sequences = [Completion(wire.decode_array(seq.tokens, f"sequences[{i}].tokens"),
                            wire.decode_array(seq.logprobs, f"sequences[{i}].logprobs"),
                            seq.stop_reason,
                            _optional(seq, "topk_token_ids", f"sequences[{i}].topk_token_ids"),
                            _optional(seq, "topk_logprobs", f"sequences[{i}].topk_logprobs"),
                            sequence_id=seq.sequence_id)
                 for i, seq in enumerate(reply.sequences)]
    prompt_logprobs = topk_ids = topk_logprobs = None
    if reply.HasField("prompt_logprobs"):
        prompt_logprobs = wire.decode_array(reply.prompt_logprobs, "prompt_logprobs")
    if reply.HasField("topk_prompt_token_ids"):
        topk_ids = wire.decode_array(reply.topk_prompt_token_ids, "topk_prompt_token_ids")
        topk_logprobs = wire.decode_array(reply.topk_prompt_logprobs, "topk_prompt_logprobs")
    return SampleResult(sequences, prompt_logprobs, topk_ids, topk_logprobs,
                        _optional(reply, "target_prompt_logprobs", "target_prompt_logprobs"),
                        _optional(reply, "prompt_alt_tokens", "prompt_alt_tokens"),
                        _optional(reply, "prompt_alt_logprobs", "prompt_alt_logprobs"),
                        reply.prompt_cache_hit_tokens)


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
           topk_prompt_logprobs: int = 0, *, topk_sample_logprobs: int = 0,
           target_prompt_logprobs: np.ndarray | None = None, prompt_alt_tokens_k: int = 0,
           prompt_logprobs_last_n: int | None = None,
           record_stability_info: bool = False) -> Call[SampleResult]:
    """`num_samples` completions of token-id array `prompt` from a sampling session.
    With `record_stability_info` the server records each sequence for stable_reinforce
    (a datum's provenance names it by `Completion.sequence_id`).

    Tinker's options: `topk_sample_logprobs` k (each sampled position's top-k),
    `target_prompt_logprobs` (int64 `[T - 1, K]` ids, -1 = none), `prompt_alt_tokens_k`
    (k draws per prompt position), `prompt_logprobs_last_n` (score the last N only).
    """
    fields: dict[str, Any] = {"topk_sample_logprobs": topk_sample_logprobs,
                              "prompt_alt_tokens_k": prompt_alt_tokens_k,
                              "prompt_logprobs_last_n": prompt_logprobs_last_n or 0,
                              "record_stability_info": record_stability_info}
    if target_prompt_logprobs is not None:
        fields["target_prompt_logprobs"] = wire.encode_array(
            np.asarray(target_prompt_logprobs, np.int64), "target_prompt_logprobs")
    return Call("sampling", "Sample", _sample_request(
        prompt, num_samples, params, sampling_session_id=sampling_session_id,
        include_prompt_logprobs=include_prompt_logprobs,
        topk_prompt_logprobs=topk_prompt_logprobs, **fields), _sample_result)


def compute_logprobs(sampling_session_id: str, prompt: np.ndarray,
                     prompt_logprobs_last_n: int | None = None) -> Call[np.ndarray]:
    """The logprob of each prompt token given the ones before it (NaN at position 0, and
    before the last `prompt_logprobs_last_n` tokens when given)."""
    return Call("sampling", "ComputeLogprobs", sampling_pb2.ComputeLogprobsRequest(
        sampling_session_id=sampling_session_id, prompt=wire.encode_array(prompt, "prompt"),
        prompt_logprobs_last_n=prompt_logprobs_last_n or 0),
        lambda reply: wire.decode_array(reply.logprobs, "logprobs"))


def sample_op(prompt: np.ndarray, num_samples: int, params: SamplingParams,
              field_name: str = "prompt") -> OpCall[SampleResult]:
    """A sample from the live adapter, queued after the model's earlier ops."""
    return UnaryOp("sampling", "Sample", _sample_request(prompt, num_samples, params,
                                                         field_name), _sample_result)
