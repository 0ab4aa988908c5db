"""ExternalWeightsService: proto -> `runtime.external` verbs (PEFT/HF exports and their
signed download URLs, which the HTTP front serves) and `runtime.imports` (adapter
uploads through signed PUT URLs of the same front)."""

from __future__ import annotations

from twinkle_server.runtime import Runtime, checkpoint_ref
from twinkle_server.service.common import (
    checkpoint_to_proto,
    op_ref,
    tenant_of,
    unary,
)
from twinkle_wire._proto.twinkle.v1 import external_pb2 as epb
from twinkle_wire._proto.twinkle.v1 import external_pb2_grpc


class ExternalWeightsServicer(external_pb2_grpc.ExternalWeightsServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.verbs = rt.external

    @unary
    async def SaveWeightsExternal(self, request, context):
        tenant = tenant_of(self.rt, context)
        row = await self.verbs.save(
            tenant, op_ref(request.op), request.name,
            ttl_seconds=request.ttl_seconds if request.HasField("ttl_seconds") else None,
            recipients=list(request.age_encryption_recipients))
        proto = checkpoint_to_proto(row, self.rt.runs.run_of(row))
        return epb.SaveWeightsExternalResponse(path=proto.path, checkpoint=proto)

    @unary
    async def GetExternalWeightsUrls(self, request, context):
        tenant = tenant_of(self.rt, context)
        ref = checkpoint_ref(request.path)
        signed = self.verbs.urls(tenant, ref)  # ownership first: another's path is NOT_FOUND
        endpoint = self.verbs.endpoint()
        return epb.ExternalWeightsUrlsResponse(
            urls={name: s.url for name, s in signed.paths.items()},
            expires_at=signed.expires, http_port=endpoint.port, https=endpoint.https)

    @unary
    async def StartUpload(self, request, context):
        tenant = tenant_of(self.rt, context)
        endpoint = self.verbs.endpoint()   # the PUTs go to the HTTP front
        lora = {"rank": request.rank}
        for key in ("train_mlp", "train_attn", "train_unembed"):
            if request.HasField(key):
                lora[key] = getattr(request, key)
        started = await self.rt.imports.start(tenant, request.base_model, lora)
        return epb.StartUploadResponse(
            upload_id=started.upload_id, urls={n: s.url for n, s in started.paths.items()},
            expires_at=started.expires, http_port=endpoint.port, https=endpoint.https)

    @unary
    async def FinishUpload(self, request, context):
        tenant = tenant_of(self.rt, context)
        row = await self.rt.imports.finish(tenant, request.upload_id)
        proto = checkpoint_to_proto(row, self.rt.runs.run_of(row))
        return epb.FinishUploadResponse(path=proto.path, checkpoint=proto)
