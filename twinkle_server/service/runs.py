"""RunsService: the calling tenant's training runs and checkpoints, and downloads."""

from __future__ import annotations

import shutil

from twinkle_client._proto.twinkle.v1 import common_pb2 as pb
from twinkle_client._proto.twinkle.v1 import runs_pb2 as rpb
from twinkle_client._proto.twinkle.v1 import runs_pb2_grpc
from twinkle_server.runtime import Runtime
from twinkle_server.service.common import (
    checkpoint_to_proto,
    run_to_proto,
    streaming,
    unary,
)
from twinkle_server.service.errors import ServiceError
from twinkle_server.service.session import file_chunks
from twinkle_server.service.training import resolve_checkpoint

DEFAULT_PAGE = 20
MAX_PAGE = 1000


def _page(limit: int, offset: int) -> tuple[int, int]:
    if limit < 0 or offset < 0:
        raise ServiceError("invalid_argument", "limit, offset: must be >= 0")
    return min(limit or DEFAULT_PAGE, MAX_PAGE), offset


class RunsServicer(runs_pb2_grpc.RunsServiceServicer):
    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def _run_proto(self, run) -> pb.TrainingRun:
        rows, _ = self.rt.store.list_checkpoints(run.tenant, run.run_id)
        last = next((r for r in rows if r.kind == "training"), None)
        last_sampler = next((r for r in rows if r.kind == "sampler"), None)
        return run_to_proto(run, run.run_id in self.rt.models, last, last_sampler)

    @unary
    async def ListRuns(self, request, context):
        tenant = self.rt.tenant(context)
        limit, offset = _page(request.limit, request.offset)
        runs, total = self.rt.store.list_runs(tenant, limit, offset)
        following = offset + len(runs)
        return rpb.ListRunsResponse(runs=[self._run_proto(r) for r in runs], total=total,
                                    next_offset=following if following < total else -1)

    @unary
    async def GetRun(self, request, context):
        run = self.rt.store.get_run(self.rt.tenant(context), request.run_id)
        if run is None:
            raise ServiceError("not_found", f"run_id: no run {request.run_id!r}")
        return self._run_proto(run)

    @unary
    async def ListCheckpoints(self, request, context):
        tenant = self.rt.tenant(context)
        if request.run_id and self.rt.store.get_run(tenant, request.run_id) is None:
            raise ServiceError("not_found", f"run_id: no run {request.run_id!r}")
        limit, offset = _page(request.limit or MAX_PAGE, request.offset)
        rows, total = self.rt.store.list_checkpoints(tenant, request.run_id or None, limit,
                                                     offset)
        runs = {r.run_id: self.rt.store.get_run(tenant, r.run_id) for r in rows}
        following = offset + len(rows)
        return rpb.ListCheckpointsResponse(
            checkpoints=[checkpoint_to_proto(r, runs[r.run_id]) for r in rows], total=total,
            next_offset=following if following < total else -1)

    @unary
    async def GetCheckpoint(self, request, context):
        tenant = self.rt.tenant(context)
        row, _ = resolve_checkpoint(self.rt, tenant, request.path)
        return checkpoint_to_proto(row, self.rt.store.get_run(tenant, row.run_id))

    @unary
    async def DeleteCheckpoint(self, request, context):
        row, directory = resolve_checkpoint(self.rt, self.rt.tenant(context), request.path)
        self.rt.store.delete_checkpoint(row)
        shutil.rmtree(directory, ignore_errors=True)
        return pb.Empty()

    @streaming
    async def DownloadCheckpoint(self, request, context):
        _, directory = resolve_checkpoint(self.rt, self.rt.tenant(context), request.path)
        names = sorted(p.name for p in directory.iterdir() if p.is_file())
        for chunk in file_chunks(directory, names):
            yield chunk
