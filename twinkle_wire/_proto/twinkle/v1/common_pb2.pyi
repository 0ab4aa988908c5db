from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
INT64: DType
INT32: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT64: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DatumBatch(_message.Message):
    __slots__ = ("lengths", "input_ids", "loss_inputs")
    class LossInputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_INPUTS_FIELD_NUMBER: _ClassVar[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    input_ids: Tensor
    loss_inputs: _containers.MessageMap[str, Tensor]
    def __init__(self, lengths: _Optional[_Iterable[int]] = ..., input_ids: _Optional[_Union[Tensor, _Mapping]] = ..., loss_inputs: _Optional[_Mapping[str, Tensor]] = ...) -> None: ...

class OpHeader(_message.Message):
    __slots__ = ("model_id", "seq_id", "request_id")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    request_id: str
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class LossFn(_message.Message):
    __slots__ = ("name", "config")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    config: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., config: _Optional[_Mapping[str, float]] = ...) -> None: ...

class LoraConfig(_message.Message):
    __slots__ = ("rank", "alpha", "dropout", "target_modules", "all_linear", "use_rslora", "seed", "train_mlp", "train_attn", "train_unembed")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    DROPOUT_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    ALL_LINEAR_FIELD_NUMBER: _ClassVar[int]
    USE_RSLORA_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    dropout: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    all_linear: bool
    use_rslora: bool
    seed: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., dropout: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ..., all_linear: _Optional[bool] = ..., use_rslora: _Optional[bool] = ..., seed: _Optional[int] = ..., train_mlp: _Optional[bool] = ..., train_attn: _Optional[bool] = ..., train_unembed: _Optional[bool] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("checkpoint_id", "checkpoint_type", "path", "run_id", "name", "created_at", "size_bytes", "has_optimizer", "base_model", "lora_rank", "user_metadata", "public", "expires_at", "train_attn", "train_mlp", "train_unembed")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TYPE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HAS_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    checkpoint_type: str
    path: str
    run_id: str
    name: str
    created_at: float
    size_bytes: int
    has_optimizer: bool
    base_model: str
    lora_rank: int
    user_metadata: _containers.ScalarMap[str, str]
    public: bool
    expires_at: float
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    def __init__(self, checkpoint_id: _Optional[str] = ..., checkpoint_type: _Optional[str] = ..., path: _Optional[str] = ..., run_id: _Optional[str] = ..., name: _Optional[str] = ..., created_at: _Optional[float] = ..., size_bytes: _Optional[int] = ..., has_optimizer: _Optional[bool] = ..., base_model: _Optional[str] = ..., lora_rank: _Optional[int] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., public: _Optional[bool] = ..., expires_at: _Optional[float] = ..., train_attn: _Optional[bool] = ..., train_mlp: _Optional[bool] = ..., train_unembed: _Optional[bool] = ...) -> None: ...

class TrainingRun(_message.Message):
    __slots__ = ("run_id", "base_model", "owner", "is_lora", "lora_rank", "created_at", "last_request_time", "last_checkpoint", "last_sampler_checkpoint", "user_metadata", "loaded", "corrupted")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    IS_LORA_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_REQUEST_TIME_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LAST_SAMPLER_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    base_model: str
    owner: str
    is_lora: bool
    lora_rank: int
    created_at: float
    last_request_time: float
    last_checkpoint: Checkpoint
    last_sampler_checkpoint: Checkpoint
    user_metadata: _containers.ScalarMap[str, str]
    loaded: bool
    corrupted: bool
    def __init__(self, run_id: _Optional[str] = ..., base_model: _Optional[str] = ..., owner: _Optional[str] = ..., is_lora: _Optional[bool] = ..., lora_rank: _Optional[int] = ..., created_at: _Optional[float] = ..., last_request_time: _Optional[float] = ..., last_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., last_sampler_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., loaded: _Optional[bool] = ..., corrupted: _Optional[bool] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("path", "offset", "data", "total_size", "last")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    data: bytes
    total_size: int
    last: bool
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ..., last: _Optional[bool] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
