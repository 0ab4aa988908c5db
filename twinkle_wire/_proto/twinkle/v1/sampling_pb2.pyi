from twinkle_wire._proto.twinkle.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateSamplingSessionRequest(_message.Message):
    __slots__ = ("session_id", "model_path", "base_model", "model_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_path: str
    base_model: str
    model_id: str
    def __init__(self, session_id: _Optional[str] = ..., model_path: _Optional[str] = ..., base_model: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...

class SamplingSessionInfo(_message.Message):
    __slots__ = ("sampling_session_id", "base_model", "model_path")
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    sampling_session_id: str
    base_model: str
    model_path: str
    def __init__(self, sampling_session_id: _Optional[str] = ..., base_model: _Optional[str] = ..., model_path: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "stop_strings", "stop_token_ids", "seed", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop_strings: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("sampling_session_id", "op", "prompt", "num_samples", "params", "include_prompt_logprobs", "topk_prompt_logprobs", "request_id", "topk_sample_logprobs", "target_prompt_logprobs", "prompt_alt_tokens_k", "prompt_logprobs_last_n", "record_stability_info")
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOPK_SAMPLE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ALT_TOKENS_K_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_LAST_N_FIELD_NUMBER: _ClassVar[int]
    RECORD_STABILITY_INFO_FIELD_NUMBER: _ClassVar[int]
    sampling_session_id: str
    op: _common_pb2.OpHeader
    prompt: _common_pb2.Tensor
    num_samples: int
    params: SamplingParams
    include_prompt_logprobs: bool
    topk_prompt_logprobs: int
    request_id: str
    topk_sample_logprobs: int
    target_prompt_logprobs: _common_pb2.Tensor
    prompt_alt_tokens_k: int
    prompt_logprobs_last_n: int
    record_stability_info: bool
    def __init__(self, sampling_session_id: _Optional[str] = ..., op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., prompt: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., num_samples: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., include_prompt_logprobs: _Optional[bool] = ..., topk_prompt_logprobs: _Optional[int] = ..., request_id: _Optional[str] = ..., topk_sample_logprobs: _Optional[int] = ..., target_prompt_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prompt_alt_tokens_k: _Optional[int] = ..., prompt_logprobs_last_n: _Optional[int] = ..., record_stability_info: _Optional[bool] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("tokens", "logprobs", "stop_reason", "topk_token_ids", "topk_logprobs", "sequence_id")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    TOPK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    tokens: _common_pb2.Tensor
    logprobs: _common_pb2.Tensor
    stop_reason: str
    topk_token_ids: _common_pb2.Tensor
    topk_logprobs: _common_pb2.Tensor
    sequence_id: str
    def __init__(self, tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., stop_reason: _Optional[str] = ..., topk_token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., topk_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sequence_id: _Optional[str] = ...) -> None: ...

class SampleResponse(_message.Message):
    __slots__ = ("sequences", "prompt_logprobs", "topk_prompt_token_ids", "topk_prompt_logprobs", "target_prompt_logprobs", "prompt_alt_tokens", "prompt_alt_logprobs", "prompt_cache_hit_tokens")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ALT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ALT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    prompt_logprobs: _common_pb2.Tensor
    topk_prompt_token_ids: _common_pb2.Tensor
    topk_prompt_logprobs: _common_pb2.Tensor
    target_prompt_logprobs: _common_pb2.Tensor
    prompt_alt_tokens: _common_pb2.Tensor
    prompt_alt_logprobs: _common_pb2.Tensor
    prompt_cache_hit_tokens: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., topk_prompt_token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., topk_prompt_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., target_prompt_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prompt_alt_tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prompt_alt_logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prompt_cache_hit_tokens: _Optional[int] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("sampling_session_id", "op", "prompt", "prompt_logprobs_last_n")
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_LAST_N_FIELD_NUMBER: _ClassVar[int]
    sampling_session_id: str
    op: _common_pb2.OpHeader
    prompt: _common_pb2.Tensor
    prompt_logprobs_last_n: int
    def __init__(self, sampling_session_id: _Optional[str] = ..., op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., prompt: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., prompt_logprobs_last_n: _Optional[int] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _common_pb2.Tensor
    def __init__(self, logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
