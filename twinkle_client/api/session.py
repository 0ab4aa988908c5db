"""SessionService and health: what the server serves and allows, whether it is up, and
its tokenizer files. Plain functions of the connection (the capabilities are kept on it)."""

from __future__ import annotations

import os
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from twinkle_client import errors
from twinkle_client.api.runs import write_files
from twinkle_client.api.values import Capabilities, ServedModel
from twinkle_client.connection import Connection
from twinkle_wire._proto.twinkle.v1 import common_pb2, session_pb2
from twinkle_wire.values import ServerLimits


def capabilities(conn: Connection, refresh: bool = False) -> Capabilities:
    """The server's served models, limits and allow-lists (kept after the first call)."""
    cached = conn.cache.get("capabilities")
    if cached is None or refresh:
        caps = conn.call(conn.session.GetServerCapabilities, common_pb2.Empty())
        cached = conn.cache["capabilities"] = Capabilities(
            models=tuple(ServedModel(m.name, tuple(m.aliases), m.max_context_length,
                                     m.vocab_size, m.trainable, m.sampleable, m.arch,
                                     m.role or "train", _limits(m.limits))
                         for m in caps.models),
            limits=_limits(caps.limits),
            scheduling=caps.scheduling, server_version=caps.server_version,
            adapters_loaded=caps.adapters_loaded, adapters_free=caps.adapters_free,
            memory_available_bytes=caps.memory_available_bytes,
            loss_functions=tuple(caps.loss_functions), optimizers=tuple(caps.optimizers),
            lr_schedulers=tuple(caps.lr_schedulers))
    return cached


def _limits(limits: session_pb2.ServerLimits) -> ServerLimits:
    return ServerLimits(limits.max_adapters, limits.max_rank, limits.max_seq_len,
                        limits.max_batch_tokens, limits.max_message_bytes,
                        limits.max_sessions_per_tenant, limits.max_adapters_per_tenant)


def health_check(conn: Connection, timeout: float) -> bool:
    """True when the standard `grpc.health.v1` check answers SERVING within `timeout` s."""
    stub = health_pb2_grpc.HealthStub(conn.channel)
    try:
        reply = conn.call(stub.Check, health_pb2.HealthCheckRequest(), timeout=timeout,
                          retry=False)
    except (errors.UnavailableError, errors.DeadlineExceededError, errors.CancelledError):
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def download_tokenizer(conn: Connection, model: str, dest: str | os.PathLike) -> Path:
    """The tokenizer files of served `model` into `dest`, so no model hub is needed."""
    chunks = conn.stream(conn.session.GetTokenizer,
                         session_pb2.GetTokenizerRequest(model=model))
    return write_files(chunks, Path(dest))

