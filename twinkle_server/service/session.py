"""SessionService: sessions with heartbeat, server capabilities, tokenizer files."""

from __future__ import annotations

from pathlib import Path

from twinkle_client._proto.twinkle.v1 import common_pb2 as pb
from twinkle_client._proto.twinkle.v1 import session_pb2 as spb
from twinkle_client._proto.twinkle.v1 import session_pb2_grpc
from twinkle_server.engine import losses, optim
from twinkle_server.engine.engine import available_memory_bytes
from twinkle_server.runtime import Runtime
from twinkle_server.service.common import metadata_of, streaming, unary
from twinkle_server.service.errors import ServiceError

FILE_CHUNK_BYTES = 1 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model",
                   "added_tokens.json", "generation_config.json", "config.json")


def file_chunks(root: Path, names: list[str]):
    """Stream files under `root` as FileChunk messages of at most 1 MiB each."""
    for name in names:
        path = root / name
        total = path.stat().st_size
        with open(path, "rb") as handle:
            offset = 0
            while True:
                data = handle.read(FILE_CHUNK_BYTES)
                last = offset + len(data) >= total
                yield pb.FileChunk(path=name, offset=offset, data=data, total_size=total,
                                   last=last)
                offset += len(data)
                if last:
                    break


class SessionServicer(session_pb2_grpc.SessionServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    @unary
    async def CreateSession(self, request, context):
        rt = self.rt
        tenant = rt.tenant(context)
        if rt.store.open_sessions(tenant) >= rt.config.max_sessions_per_tenant:
            raise ServiceError("resource_exhausted",
                               f"sessions: tenant has {rt.config.max_sessions_per_tenant} open "
                               "sessions (--max-sessions-per-tenant); close one first")
        session_id = rt.store.create_session(tenant, metadata_of(request.tags, "tags"))
        timeout = rt.config.session_timeout
        return spb.CreateSessionResponse(session_id=session_id, session_timeout_s=timeout,
                                         heartbeat_interval_s=max(0.5, timeout / 5))

    def _own_session(self, context, session_id: str) -> None:
        if self.rt.store.session_tenant(session_id) != self.rt.tenant(context):
            raise ServiceError("not_found", f"session_id: no open session {session_id!r}")

    @unary
    async def Heartbeat(self, request, context):
        self._own_session(context, request.session_id)
        self.rt.store.heartbeat(request.session_id)
        return spb.HeartbeatResponse(expires_in_s=self.rt.config.session_timeout)

    @unary
    async def CloseSession(self, request, context):
        self._own_session(context, request.session_id)
        self.rt.store.close_session(request.session_id)
        await self.rt.close_session_models(request.session_id, "session closed")
        return pb.Empty()

    @unary
    async def GetServerCapabilities(self, request, context):
        rt = self.rt
        rt.tenant(context)
        base = rt.engine.base
        cfg = rt.config
        loaded = len(rt.models)
        return spb.ServerCapabilities(
            models=[spb.ServedModel(name=cfg.model, aliases=list(cfg.model_alias),
                                    max_context_length=min(cfg.max_seq_len, base.max_seq_len),
                                    vocab_size=base.vocab_size, trainable=True, sampleable=True,
                                    arch=base.arch)],
            limits=spb.ServerLimits(max_adapters=cfg.max_adapters, max_rank=cfg.max_rank,
                                    max_seq_len=cfg.max_seq_len,
                                    max_batch_tokens=cfg.max_batch_tokens,
                                    max_message_bytes=4 * 1024 * 1024,
                                    max_sessions_per_tenant=cfg.max_sessions_per_tenant,
                                    max_adapters_per_tenant=cfg.max_adapters_per_tenant),
            scheduling=cfg.scheduling, server_version="0.1.0", adapters_loaded=loaded,
            adapters_free=max(0, cfg.max_adapters - loaded),
            memory_available_bytes=available_memory_bytes(base.device) or 0,
            loss_functions=sorted(losses.LOSS_NAMES), optimizers=sorted(optim.OPTIMIZERS),
            lr_schedulers=sorted(optim.SCHEDULERS))

    @streaming
    async def GetTokenizer(self, request, context):
        rt = self.rt
        rt.tenant(context)
        rt.check_base_model(request.model)
        root = rt.engine.base.model_dir
        names = [n for n in TOKENIZER_FILES if (root / n).is_file()]
        for chunk in file_chunks(root, names):
            yield chunk
