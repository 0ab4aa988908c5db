from google.protobuf import struct_pb2 as _struct_pb2
from twinkle_wire._proto.twinkle.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateModelRequest(_message.Message):
    __slots__ = ("session_id", "base_model", "lora", "user_metadata", "gradient_accumulation_steps", "from_checkpoint", "load_optimizer", "request_id")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_ACCUMULATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    FROM_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LOAD_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    base_model: str
    lora: _common_pb2.LoraConfig
    user_metadata: _containers.ScalarMap[str, str]
    gradient_accumulation_steps: int
    from_checkpoint: str
    load_optimizer: bool
    request_id: str
    def __init__(self, session_id: _Optional[str] = ..., base_model: _Optional[str] = ..., lora: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., gradient_accumulation_steps: _Optional[int] = ..., from_checkpoint: _Optional[str] = ..., load_optimizer: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "base_model", "arch", "tokenizer_id", "is_lora", "lora", "next_seq_id", "target_modules", "trainable_params", "state_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    IS_LORA_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    base_model: str
    arch: str
    tokenizer_id: str
    is_lora: bool
    lora: _common_pb2.LoraConfig
    next_seq_id: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    trainable_params: int
    state_bytes: int
    def __init__(self, model_id: _Optional[str] = ..., base_model: _Optional[str] = ..., arch: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., is_lora: _Optional[bool] = ..., lora: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., next_seq_id: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., trainable_params: _Optional[int] = ..., state_bytes: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ForwardHeader(_message.Message):
    __slots__ = ("op", "loss", "num_datums")
    OP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_DATUMS_FIELD_NUMBER: _ClassVar[int]
    op: _common_pb2.OpHeader
    loss: _common_pb2.LossFn
    num_datums: int
    def __init__(self, op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., loss: _Optional[_Union[_common_pb2.LossFn, _Mapping]] = ..., num_datums: _Optional[int] = ...) -> None: ...

class ForwardChunk(_message.Message):
    __slots__ = ("header", "batch", "provenance")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PROVENANCE_FIELD_NUMBER: _ClassVar[int]
    header: ForwardHeader
    batch: _common_pb2.DatumBatch
    provenance: _containers.RepeatedCompositeFieldContainer[DatumProvenance]
    def __init__(self, header: _Optional[_Union[ForwardHeader, _Mapping]] = ..., batch: _Optional[_Union[_common_pb2.DatumBatch, _Mapping]] = ..., provenance: _Optional[_Iterable[_Union[DatumProvenance, _Mapping]]] = ...) -> None: ...

class ProvenanceSpan(_message.Message):
    __slots__ = ("sequence_id", "offset", "length", "sampled")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    offset: int
    length: int
    sampled: bool
    def __init__(self, sequence_id: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., sampled: _Optional[bool] = ...) -> None: ...

class DatumProvenance(_message.Message):
    __slots__ = ("model_input_spans", "loss_fn_input_spans")
    MODEL_INPUT_SPANS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_INPUT_SPANS_FIELD_NUMBER: _ClassVar[int]
    model_input_spans: _containers.RepeatedCompositeFieldContainer[ProvenanceSpan]
    loss_fn_input_spans: _containers.RepeatedCompositeFieldContainer[ProvenanceSpan]
    def __init__(self, model_input_spans: _Optional[_Iterable[_Union[ProvenanceSpan, _Mapping]]] = ..., loss_fn_input_spans: _Optional[_Iterable[_Union[ProvenanceSpan, _Mapping]]] = ...) -> None: ...

class DatumOutput(_message.Message):
    __slots__ = ("outputs",)
    class OutputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.MessageMap[str, _common_pb2.Tensor]
    def __init__(self, outputs: _Optional[_Mapping[str, _common_pb2.Tensor]] = ...) -> None: ...

class ForwardResultChunk(_message.Message):
    __slots__ = ("outputs", "done", "loss", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    done: bool
    loss: float
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ..., done: _Optional[bool] = ..., loss: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("op", "adam")
    OP_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    op: _common_pb2.OpHeader
    adam: AdamParams
    def __init__(self, op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., adam: _Optional[_Union[AdamParams, _Mapping]] = ...) -> None: ...

class MetricsResponse(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class OpRequest(_message.Message):
    __slots__ = ("op",)
    OP_FIELD_NUMBER: _ClassVar[int]
    op: _common_pb2.OpHeader
    def __init__(self, op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ...) -> None: ...

class OpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("op", "name", "kwargs")
    OP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    op: _common_pb2.OpHeader
    name: str
    kwargs: _struct_pb2.Struct
    def __init__(self, op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., name: _Optional[str] = ..., kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class SetLossRequest(_message.Message):
    __slots__ = ("op", "loss")
    OP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    op: _common_pb2.OpHeader
    loss: _common_pb2.LossFn
    def __init__(self, op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., loss: _Optional[_Union[_common_pb2.LossFn, _Mapping]] = ...) -> None: ...

class ClipGradNormRequest(_message.Message):
    __slots__ = ("op", "max_norm")
    OP_FIELD_NUMBER: _ClassVar[int]
    MAX_NORM_FIELD_NUMBER: _ClassVar[int]
    op: _common_pb2.OpHeader
    max_norm: float
    def __init__(self, op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., max_norm: _Optional[float] = ...) -> None: ...

class CalculateMetricRequest(_message.Message):
    __slots__ = ("op", "is_training")
    OP_FIELD_NUMBER: _ClassVar[int]
    IS_TRAINING_FIELD_NUMBER: _ClassVar[int]
    op: _common_pb2.OpHeader
    is_training: bool
    def __init__(self, op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., is_training: _Optional[bool] = ...) -> None: ...

class TrainConfigs(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("op", "name", "include_optimizer", "user_metadata", "overwrite", "ephemeral", "inflight")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    op: _common_pb2.OpHeader
    name: str
    include_optimizer: bool
    user_metadata: _containers.ScalarMap[str, str]
    overwrite: bool
    ephemeral: bool
    inflight: bool
    def __init__(self, op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., name: _Optional[str] = ..., include_optimizer: _Optional[bool] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., overwrite: _Optional[bool] = ..., ephemeral: _Optional[bool] = ..., inflight: _Optional[bool] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("path", "checkpoint", "sampling_session_id")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    path: str
    checkpoint: _common_pb2.Checkpoint
    sampling_session_id: str
    def __init__(self, path: _Optional[str] = ..., checkpoint: _Optional[_Union[_common_pb2.Checkpoint, _Mapping]] = ..., sampling_session_id: _Optional[str] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("op", "path", "include_optimizer")
    OP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    op: _common_pb2.OpHeader
    path: str
    include_optimizer: bool
    def __init__(self, op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., path: _Optional[str] = ..., include_optimizer: _Optional[bool] = ...) -> None: ...
