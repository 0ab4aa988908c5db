"""RunsService: proto -> `runtime.runs` verbs (the tenant's runs, checkpoints, downloads)."""

from __future__ import annotations

import json

from twinkle_server.runtime import Runtime, checkpoint_ref
from twinkle_server.runtime.copies import MAX_IDEMPOTENCY_KEY_CHARS
from twinkle_server.service.common import (
    checkpoint_to_proto,
    run_to_proto,
    streaming,
    tenant_of,
    unary,
)
from twinkle_server.service.session import file_chunks
from twinkle_wire import paths
from twinkle_wire._proto.twinkle.v1 import common_pb2 as pb
from twinkle_wire._proto.twinkle.v1 import runs_pb2 as rpb
from twinkle_wire._proto.twinkle.v1 import runs_pb2_grpc


class RunsServicer(runs_pb2_grpc.RunsServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.verbs = rt.runs

    @unary
    async def ListRuns(self, request, context):
        page = self.verbs.list_runs(tenant_of(self.rt, context), request.limit, request.offset)
        return rpb.ListRunsResponse(runs=[run_to_proto(v) for v in page.items],
                                    total=page.total, next_offset=page.next_offset)

    @unary
    async def GetRun(self, request, context):
        return run_to_proto(self.verbs.get_run(tenant_of(self.rt, context), request.run_id))

    @unary
    async def ListCheckpoints(self, request, context):
        page = self.verbs.list_checkpoints(tenant_of(self.rt, context), request.run_id,
                                           request.limit, request.offset)
        return rpb.ListCheckpointsResponse(
            checkpoints=[checkpoint_to_proto(row, run) for row, run in page.items],
            total=page.total, next_offset=page.next_offset)

    @unary
    async def GetCheckpoint(self, request, context):
        row, run = self.verbs.get_checkpoint(tenant_of(self.rt, context),
                                             checkpoint_ref(request.path))
        return checkpoint_to_proto(row, run)

    @unary
    async def DeleteCheckpoint(self, request, context):
        await self.verbs.delete_checkpoint(tenant_of(self.rt, context),
                                           checkpoint_ref(request.path))
        return pb.Empty()

    @streaming
    async def DownloadCheckpoint(self, request, context):
        directory, names = self.verbs.checkpoint_files(tenant_of(self.rt, context),
                                                       checkpoint_ref(request.path))
        for chunk in file_chunks(directory, names):
            yield chunk

    @unary
    async def PublishCheckpoint(self, request, context):
        await self.verbs.publish_checkpoint(tenant_of(self.rt, context),
                                            checkpoint_ref(request.path), request.public)
        return pb.Empty()

    @unary
    async def SetCheckpointTtl(self, request, context):
        ttl = request.ttl_seconds if request.HasField("ttl_seconds") else None
        await self.verbs.set_checkpoint_ttl(tenant_of(self.rt, context),
                                            checkpoint_ref(request.path), ttl)
        return pb.Empty()

    @unary
    async def CopyCheckpoint(self, request, context):
        tenant = tenant_of(self.rt, context)
        reader = (self.rt.copies.reader_of(request.weights_access_token)
                  if request.weights_access_token else None)
        row = await self.rt.copies.copy(
            tenant, checkpoint_ref(request.source_path, "source_path"), reader=reader,
            session_id=request.session_id or None,
            ttl_seconds=request.ttl_seconds if request.HasField("ttl_seconds") else None,
            destination=request.destination_project_id,
            idempotency_key=request.idempotency_key[:MAX_IDEMPOTENCY_KEY_CHARS])
        return rpb.CopyCheckpointResponse(path=paths.tinker_path(row.run_id, row.checkpoint_id))

    @unary
    async def GetAuditLog(self, request, context):
        rows = await self.rt.audit.entries(tenant_of(self.rt, context),
                                           request.event_type or "all", request.day)
        return rpb.GetAuditLogResponse(entries=[
            rpb.AuditLogEntry(timestamp=r.at, event=r.event,
                              event_details_json=json.dumps(r.details, sort_keys=True))
            for r in rows])
