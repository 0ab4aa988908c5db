"""RunsService: the tenant's training runs and checkpoints, as `Call`s, and checkpoint
downloads."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from twinkle_client import errors
from twinkle_client.api.calls import Call, no_reply
from twinkle_client.api.values import AuditEntry, Checkpoint, Page, TrainingRun
from twinkle_client.connection import Connection
from twinkle_wire._proto.twinkle.v1 import common_pb2, runs_pb2


def _checkpoint(c: common_pb2.Checkpoint) -> Checkpoint:
    return Checkpoint(c.checkpoint_id, c.checkpoint_type, c.path, c.run_id, c.name,
                      c.created_at, c.size_bytes, c.has_optimizer, c.base_model, c.lora_rank,
                      dict(c.user_metadata), c.public, c.expires_at or None,
                      *(getattr(c, name) if c.HasField(name) else None
                        for name in ("train_attn", "train_mlp", "train_unembed")))


def _run(r: common_pb2.TrainingRun) -> TrainingRun:
    return TrainingRun(
        r.run_id, r.base_model, r.owner, r.is_lora, r.lora_rank, r.created_at,
        r.last_request_time,
        _checkpoint(r.last_checkpoint) if r.HasField("last_checkpoint") else None,
        _checkpoint(r.last_sampler_checkpoint) if r.HasField("last_sampler_checkpoint")
        else None, dict(r.user_metadata), r.loaded, r.corrupted)


def list_runs(limit: int = 0, offset: int = 0) -> Call[Page[TrainingRun]]:
    """A page of the tenant's training runs (`limit` 0: the server's default page)."""
    return Call("runs", "ListRuns", runs_pb2.ListRunsRequest(limit=limit, offset=offset),
                lambda reply: Page([_run(r) for r in reply.runs], reply.total,
                                   reply.next_offset))


def get_run(run_id: str) -> Call[TrainingRun]:
    return Call("runs", "GetRun", runs_pb2.GetRunRequest(run_id=run_id), _run)


def list_checkpoints(run_id: str = "", limit: int = 0, offset: int = 0
                     ) -> Call[Page[Checkpoint]]:
    """A page of one run's checkpoints, or with `run_id` empty every run's, newest first."""
    return Call("runs", "ListCheckpoints", runs_pb2.ListCheckpointsRequest(
        run_id=run_id, limit=limit, offset=offset),
        lambda reply: Page([_checkpoint(c) for c in reply.checkpoints], reply.total,
                           reply.next_offset))


def get_checkpoint(path: str) -> Call[Checkpoint]:
    return Call("runs", "GetCheckpoint", runs_pb2.CheckpointRef(path=path), _checkpoint)


def delete_checkpoint(path: str) -> Call[None]:
    return Call("runs", "DeleteCheckpoint", runs_pb2.CheckpointRef(path=path), no_reply,
                retry=False)


def publish_checkpoint(path: str, public: bool) -> Call[None]:
    """Make an own checkpoint readable by every tenant (`public`), or private again."""
    return Call("runs", "PublishCheckpoint",
                runs_pb2.PublishCheckpointRequest(path=path, public=public), no_reply)


def set_checkpoint_ttl(path: str, ttl_seconds: int | None) -> Call[None]:
    """Delete an own checkpoint `ttl_seconds` from now; None: never."""
    request = runs_pb2.SetCheckpointTtlRequest(path=path)
    if ttl_seconds is not None:
        request.ttl_seconds = ttl_seconds
    return Call("runs", "SetCheckpointTtl", request, no_reply)


def copy_checkpoint(source_path: str, *, destination_project_id: str = "",
                    session_id: str = "", ttl_seconds: int | None = None,
                    weights_access_token: str = "", idempotency_key: str = "") -> Call[str]:
    """Copy a checkpoint the tenant may read (or, with `weights_access_token`, that key's
    tenant may read) into a new run of the tenant; returns the copy's path. A retry with
    the same `idempotency_key` answers the same copy."""
    request = runs_pb2.CopyCheckpointRequest(
        source_path=source_path, destination_project_id=destination_project_id,
        session_id=session_id, weights_access_token=weights_access_token,
        idempotency_key=idempotency_key)
    if ttl_seconds is not None:
        request.ttl_seconds = ttl_seconds
    return Call("runs", "CopyCheckpoint", request, lambda reply: reply.path)


def get_audit_log(event_type: str = "all", day: str = "") -> Call[list[AuditEntry]]:
    """The tenant's audit log entries of one UTC day (`day` YYYY-MM-DD, empty: today),
    oldest first; `event_type` all, checkpoints, models, sessions, ..."""
    return Call("runs", "GetAuditLog", runs_pb2.GetAuditLogRequest(event_type=event_type,
                                                                  day=day),
                lambda reply: [AuditEntry(e.timestamp, e.event, json.loads(e.event_details_json))
                               for e in reply.entries])


def download_checkpoint(conn: Connection, path: str, dest: str | os.PathLike) -> Path:
    """Every file of checkpoint `path` into directory `dest` (made if missing)."""
    chunks = conn.stream(conn.runs.DownloadCheckpoint, runs_pb2.CheckpointRef(path=path))
    return write_files(chunks, Path(dest))


def write_files(chunks: Iterator[common_pb2.FileChunk], dest: Path) -> Path:
    """Write streamed files into `dest` through a temp dir, so `dest` never holds a partial
    download. File names from the server are checked: they may not leave `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=dest.parent))
    try:
        for chunk in chunks:
            name = chunk.path
            if not name or "/" in name or "\\" in name or name in (".", ".."):
                raise errors.InvalidArgumentError(f"download: server sent an unsafe file "
                                                  f"name {name!r}")
            with open(staging / name, "ab" if chunk.offset else "wb") as handle:
                handle.write(chunk.data)
        dest.mkdir(exist_ok=True)
        for item in staging.iterdir():
            os.replace(item, dest / item.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest
