from twinkle_wire._proto.twinkle.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateSessionRequest(_message.Message):
    __slots__ = ("tags", "client_name")
    class TagsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TAGS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.ScalarMap[str, str]
    client_name: str
    def __init__(self, tags: _Optional[_Mapping[str, str]] = ..., client_name: _Optional[str] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id", "heartbeat_interval_s", "session_timeout_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    SESSION_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    heartbeat_interval_s: float
    session_timeout_s: float
    def __init__(self, session_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., session_timeout_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("expires_in_s",)
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    expires_in_s: float
    def __init__(self, expires_in_s: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ServedModel(_message.Message):
    __slots__ = ("name", "aliases", "max_context_length", "vocab_size", "trainable", "sampleable", "arch", "role", "limits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLEABLE_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    max_context_length: int
    vocab_size: int
    trainable: bool
    sampleable: bool
    arch: str
    role: str
    limits: ServerLimits
    def __init__(self, name: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., max_context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., trainable: _Optional[bool] = ..., sampleable: _Optional[bool] = ..., arch: _Optional[str] = ..., role: _Optional[str] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ...) -> None: ...

class ServerLimits(_message.Message):
    __slots__ = ("max_adapters", "max_rank", "max_seq_len", "max_batch_tokens", "max_message_bytes", "max_sessions_per_tenant", "max_adapters_per_tenant")
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_PER_TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_PER_TENANT_FIELD_NUMBER: _ClassVar[int]
    max_adapters: int
    max_rank: int
    max_seq_len: int
    max_batch_tokens: int
    max_message_bytes: int
    max_sessions_per_tenant: int
    max_adapters_per_tenant: int
    def __init__(self, max_adapters: _Optional[int] = ..., max_rank: _Optional[int] = ..., max_seq_len: _Optional[int] = ..., max_batch_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_sessions_per_tenant: _Optional[int] = ..., max_adapters_per_tenant: _Optional[int] = ...) -> None: ...

class ServerCapabilities(_message.Message):
    __slots__ = ("models", "limits", "scheduling", "server_version", "adapters_loaded", "adapters_free", "memory_available_bytes", "loss_functions", "optimizers", "lr_schedulers")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_LOADED_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FREE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOSS_FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZERS_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULERS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ServedModel]
    limits: ServerLimits
    scheduling: str
    server_version: str
    adapters_loaded: int
    adapters_free: int
    memory_available_bytes: int
    loss_functions: _containers.RepeatedScalarFieldContainer[str]
    optimizers: _containers.RepeatedScalarFieldContainer[str]
    lr_schedulers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, models: _Optional[_Iterable[_Union[ServedModel, _Mapping]]] = ..., limits: _Optional[_Union[ServerLimits, _Mapping]] = ..., scheduling: _Optional[str] = ..., server_version: _Optional[str] = ..., adapters_loaded: _Optional[int] = ..., adapters_free: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., loss_functions: _Optional[_Iterable[str]] = ..., optimizers: _Optional[_Iterable[str]] = ..., lr_schedulers: _Optional[_Iterable[str]] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...
