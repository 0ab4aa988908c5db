from twinkle_wire._proto.twinkle.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StartUploadRequest(_message.Message):
    __slots__ = ("base_model", "rank", "train_mlp", "train_attn", "train_unembed")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    rank: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    def __init__(self, base_model: _Optional[str] = ..., rank: _Optional[int] = ..., train_mlp: _Optional[bool] = ..., train_attn: _Optional[bool] = ..., train_unembed: _Optional[bool] = ...) -> None: ...

class StartUploadResponse(_message.Message):
    __slots__ = ("upload_id", "urls", "expires_at", "http_port", "https")
    class UrlsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    URLS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    HTTPS_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    urls: _containers.ScalarMap[str, str]
    expires_at: int
    http_port: int
    https: bool
    def __init__(self, upload_id: _Optional[str] = ..., urls: _Optional[_Mapping[str, str]] = ..., expires_at: _Optional[int] = ..., http_port: _Optional[int] = ..., https: _Optional[bool] = ...) -> None: ...

class FinishUploadRequest(_message.Message):
    __slots__ = ("upload_id",)
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    def __init__(self, upload_id: _Optional[str] = ...) -> None: ...

class FinishUploadResponse(_message.Message):
    __slots__ = ("path", "checkpoint")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    path: str
    checkpoint: _common_pb2.Checkpoint
    def __init__(self, path: _Optional[str] = ..., checkpoint: _Optional[_Union[_common_pb2.Checkpoint, _Mapping]] = ...) -> None: ...

class SaveWeightsExternalRequest(_message.Message):
    __slots__ = ("op", "name", "ttl_seconds", "age_encryption_recipients")
    OP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AGE_ENCRYPTION_RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    op: _common_pb2.OpHeader
    name: str
    ttl_seconds: int
    age_encryption_recipients: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, op: _Optional[_Union[_common_pb2.OpHeader, _Mapping]] = ..., name: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., age_encryption_recipients: _Optional[_Iterable[str]] = ...) -> None: ...

class SaveWeightsExternalResponse(_message.Message):
    __slots__ = ("path", "checkpoint")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    path: str
    checkpoint: _common_pb2.Checkpoint
    def __init__(self, path: _Optional[str] = ..., checkpoint: _Optional[_Union[_common_pb2.Checkpoint, _Mapping]] = ...) -> None: ...

class ExternalWeightsUrlsRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ExternalWeightsUrlsResponse(_message.Message):
    __slots__ = ("urls", "expires_at", "http_port", "https")
    class UrlsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    URLS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    HTTPS_FIELD_NUMBER: _ClassVar[int]
    urls: _containers.ScalarMap[str, str]
    expires_at: int
    http_port: int
    https: bool
    def __init__(self, urls: _Optional[_Mapping[str, str]] = ..., expires_at: _Optional[int] = ..., http_port: _Optional[int] = ..., https: _Optional[bool] = ...) -> None: ...
