"""ExternalWeightsService: PEFT/HF exports of a model (`save_weights_external`, an ordered
op) and the signed URLs that download their files from the server's HTTP front."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twinkle_client.api.calls import Call, OpCall, UnaryOp
from twinkle_client.connection import Connection
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
    host = conn.target.rsplit(":", 1)[0]
    base = f"{'https' if reply.https else 'http'}://{host}:{reply.http_port}"
    return ExternalWeightsUrls({name: base + rel for name, rel in reply.urls.items()},
                               reply.expires_at)
