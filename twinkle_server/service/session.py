"""SessionService: proto -> `runtime.runs` session verbs, capabilities, tokenizer files."""

from __future__ import annotations

from pathlib import Path

from twinkle_server.runtime import Runtime
from twinkle_server.service.common import streaming, tenant_of, unary
from twinkle_wire import MAX_MESSAGE_BYTES
from twinkle_wire._proto.twinkle.v1 import common_pb2 as pb
from twinkle_wire._proto.twinkle.v1 import session_pb2 as spb
from twinkle_wire._proto.twinkle.v1 import session_pb2_grpc

FILE_CHUNK_BYTES = 1 << 20


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
        self.verbs = rt.runs

    @unary
    async def CreateSession(self, request, context):
        session_id = await self.verbs.create_session(tenant_of(self.rt, context),
                                                     dict(request.tags))
        timeout = self.rt.config.session_timeout
        return spb.CreateSessionResponse(session_id=session_id, session_timeout_s=timeout,
                                         heartbeat_interval_s=max(0.5, timeout / 5))

    @unary
    async def Heartbeat(self, request, context):
        await self.verbs.heartbeat(tenant_of(self.rt, context), request.session_id)
        return spb.HeartbeatResponse(expires_in_s=self.rt.config.session_timeout)

    @unary
    async def CloseSession(self, request, context):
        await self.verbs.close_session(tenant_of(self.rt, context), request.session_id)
        return pb.Empty()

    @unary
    async def GetServerCapabilities(self, request, context):
        tenant_of(self.rt, context)
        caps, cfg = self.verbs.capabilities(), self.rt.config
        models = caps["models"]
        first = models[0]["limits"]
        return spb.ServerCapabilities(
            models=[spb.ServedModel(name=m["name"], aliases=m["aliases"],
                                    max_context_length=m["max_context_length"],
                                    vocab_size=m["vocab_size"], trainable=m["trainable"],
                                    sampleable=m["sampleable"], arch=m["arch"], role=m["role"],
                                    limits=spb.ServerLimits(**m["limits"]))
                    for m in models],
            limits=spb.ServerLimits(max_adapters=first["max_adapters"],
                                    max_rank=first["max_rank"],
                                    max_seq_len=first["max_seq_len"],
                                    max_batch_tokens=min(m["limits"]["max_batch_tokens"]
                                                         for m in models),
                                    max_message_bytes=MAX_MESSAGE_BYTES,
                                    max_sessions_per_tenant=cfg.max_sessions_per_tenant,
                                    max_adapters_per_tenant=cfg.max_adapters_per_tenant),
            scheduling=cfg.scheduling, server_version="0.1.0",
            adapters_loaded=caps["adapters_loaded"], adapters_free=caps["adapters_free"],
            memory_available_bytes=caps["memory_available_bytes"],
            loss_functions=caps["loss_functions"], optimizers=caps["optimizers"],
            lr_schedulers=caps["lr_schedulers"])

    @streaming
    async def GetTokenizer(self, request, context):
        tenant_of(self.rt, context)
        root, names = self.verbs.tokenizer_files(request.model)
        for chunk in file_chunks(root, names):
            yield chunk
