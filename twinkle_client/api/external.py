"""ExternalWeightsService: PEFT/HF exports of a model (`save_weights_external`, an ordered
op) and the signed URLs that download their files from the server's HTTP front; adapter
import (`start_upload`, PUT each file to its URL, `finish_upload`)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_client.api.calls import Call, OpCall, UnaryOp
from twinkle_client.connection import CALL_TIMEOUT_S, Connection
from twinkle_wire._proto.twinkle.v1 import external_pb2


@dataclass(frozen=True)
class ExternalWeightsUrls:
    """One signed download URL per file of an external weights checkpoint (each works
    with no API key until `expires_at`, unix seconds)."""

    urls: dict[str, str]
    expires_at: int


def save_weights_external(name: str, ttl_seconds: int | None = None,
                          age_encryption_recipients: Sequence[str] | None = None
                          ) -> OpCall[str]:
    """Export the adapter in PEFT format as `external_weights/<name>`, each file encrypted
    to the age recipients when given (stored as `<file>.age`); returns its path."""
    request = external_pb2.SaveWeightsExternalRequest(
        name=name, age_encryption_recipients=list(age_encryption_recipients or ()))
    if ttl_seconds is not None:
        request.ttl_seconds = ttl_seconds
    return UnaryOp("external", "SaveWeightsExternal", request, lambda reply: reply.path)


def external_weights_urls(conn: Connection, path: str) -> ExternalWeightsUrls:
    """Signed URLs for every file of external weights checkpoint `path`, on the host this
    connection reaches the server at and the port of its HTTP front."""
    reply = Call("external", "GetExternalWeightsUrls",
                 external_pb2.ExternalWeightsUrlsRequest(path=path), lambda r: r).send(conn)
    return ExternalWeightsUrls(_absolute(conn, reply), reply.expires_at)


def _absolute(conn: Connection, reply: Any) -> dict[str, str]:
    """A reply's front-relative URLs on the host this connection reaches the server at."""
    host = conn.target.rsplit(":", 1)[0]
    base = f"{'https' if reply.https else 'http'}://{host}:{reply.http_port}"
    return {name: base + rel for name, rel in reply.urls.items()}


@dataclass(frozen=True)
class Upload:
    """A started adapter upload: PUT each file to its URL (no API key, once each) before
    `expires_at` (unix seconds), then `finish_upload(upload_id)`."""

    upload_id: str
    urls: dict[str, str]
    expires_at: int


def start_upload(conn: Connection, base_model: str, rank: int, train_mlp: bool = True,
                 train_attn: bool = True, train_unembed: bool = True) -> Upload:
    """Start importing a PEFT LoRA of `rank` for served model `base_model`."""
    reply = Call("external", "StartUpload", external_pb2.StartUploadRequest(
        base_model=base_model, rank=rank, train_mlp=train_mlp, train_attn=train_attn,
        train_unembed=train_unembed), lambda r: r).send(conn)
    return Upload(reply.upload_id, _absolute(conn, reply), reply.expires_at)


def put_files(conn: Connection, upload: Upload, directory: str | os.PathLike) -> None:
    """PUT each file of `upload` from `directory` to its signed URL (HTTP, no API key);
    a refusal raises the connection's error for its category."""
    for name, url in upload.urls.items():
        path = Path(directory) / name
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the upload needs it (one of {sorted(upload.urls)})")
        with open(path, "rb") as handle:
            request = urllib.request.Request(url, data=handle, method="PUT", headers={
                "content-length": str(path.stat().st_size),
                "content-type": "application/octet-stream"})
            try:
                urllib.request.urlopen(request, timeout=CALL_TIMEOUT_S).close()
            except urllib.error.HTTPError as exc:
                try:
                    body = json.loads(exc.read() or b"{}")
                except ValueError:
                    body = {}
                raise conn.error_factory(body.get("category", "internal"),
                                         f"{name}: {body.get('detail', exc.reason)}",
                                         "PUT upload") from None


def finish_upload(conn: Connection, upload_id: str) -> str:
    """The uploaded adapter, checked, as a checkpoint of the caller's: its path."""
    return Call("external", "FinishUpload",
                external_pb2.FinishUploadRequest(upload_id=upload_id),
                lambda r: r.path).send(conn)
