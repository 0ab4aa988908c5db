from twinkle_wire._proto.twinkle.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PublishCheckpointRequest(_message.Message):
    __slots__ = ("path", "public")
    PATH_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    path: str
    public: bool
    def __init__(self, path: _Optional[str] = ..., public: _Optional[bool] = ...) -> None: ...

class SetCheckpointTtlRequest(_message.Message):
    __slots__ = ("path", "ttl_seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    ttl_seconds: int
    def __init__(self, path: _Optional[str] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ("limit", "offset")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    limit: int
    offset: int
    def __init__(self, limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListRunsResponse(_message.Message):
    __slots__ = ("runs", "total", "next_offset")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TrainingRun]
    total: int
    next_offset: int
    def __init__(self, runs: _Optional[_Iterable[_Union[_common_pb2.TrainingRun, _Mapping]]] = ..., total: _Optional[int] = ..., next_offset: _Optional[int] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("run_id", "limit", "offset")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    limit: int
    offset: int
    def __init__(self, run_id: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints", "total", "next_offset")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[_common_pb2.Checkpoint]
    total: int
    next_offset: int
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[_common_pb2.Checkpoint, _Mapping]]] = ..., total: _Optional[int] = ..., next_offset: _Optional[int] = ...) -> None: ...

class CheckpointRef(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CopyCheckpointRequest(_message.Message):
    __slots__ = ("source_path", "destination_project_id", "session_id", "ttl_seconds", "weights_access_token", "idempotency_key")
    SOURCE_PATH_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ACCESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    source_path: str
    destination_project_id: str
    session_id: str
    ttl_seconds: int
    weights_access_token: str
    idempotency_key: str
    def __init__(self, source_path: _Optional[str] = ..., destination_project_id: _Optional[str] = ..., session_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., weights_access_token: _Optional[str] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class CopyCheckpointResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class GetAuditLogRequest(_message.Message):
    __slots__ = ("event_type", "day")
    EVENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    DAY_FIELD_NUMBER: _ClassVar[int]
    event_type: str
    day: str
    def __init__(self, event_type: _Optional[str] = ..., day: _Optional[str] = ...) -> None: ...

class AuditLogEntry(_message.Message):
    __slots__ = ("timestamp", "event", "event_details_json")
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    EVENT_DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    timestamp: float
    event: str
    event_details_json: str
    def __init__(self, timestamp: _Optional[float] = ..., event: _Optional[str] = ..., event_details_json: _Optional[str] = ...) -> None: ...

class GetAuditLogResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AuditLogEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[AuditLogEntry, _Mapping]]] = ...) -> None: ...
