"""External weights over the Tinker REST API (`runtime.external`):

- `POST /api/v1/save_weights_external` (`TrainingClient.save_weights_external`): an op of
  the model, answered with a future whose result is the export's `tinker://` path;
- `GET /api/v1/training_runs/{run_id}/checkpoints/external_weights/{name}/
  external_weights_urls` (`RestClient.get_external_weights_urls`): one signed URL per
  file, on the host and scheme the caller used to reach this front;
- `GET /api/v1/external_weights/{run_id}/{name}/{file}?expires=&signature=`: the file,
  with no API key, while the signature is good (403 otherwise; 404 once the checkpoint is
  deleted or expired). This is what `tinker_cookbook.weights.download` fetches.

And the way in (`runtime.imports`, Tinker 0.39's `RestClient.external_weights_upload_*`):

- `POST /api/v1/external_weights_upload_start` (`base_model`, `lora_config`): an
  `upload_id`, one signed PUT URL per file, and when they expire;
- `PUT /api/v1/external_weights_upload/{upload_id}/{file}?expires=&signature=&reader=`:
  one file, with no API key, once;
- `POST /api/v1/external_weights_upload_finish` (`upload_id`): the files checked against
  the base, and the new checkpoint's `tinker://.../external_weights/imported` path.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse
from starlette.routing import Route

from twinkle_server.engine.errors import EngineError
from twinkle_server.http import convert
from twinkle_server.http.app import Front, json_body, route
from twinkle_server.runtime import checkpoint_ref
from twinkle_server.runtime.external import DOWNLOAD_PREFIX, parse_recipients
from twinkle_server.runtime.imports import UPLOAD_PREFIX
from twinkle_server.runtime.runs import check_ttl
from twinkle_wire import paths


class ExternalRoutes:
    def __init__(self, front: Front) -> None:
        self.front = front
        self.rt = front.rt

    @route
    async def save_weights_external(self, request: Request) -> Any:
        front = self.front
        tenant = front.tenant(request)
        body = await json_body(request)
        ref = front.op(tenant, body, rid := front._id())
        try:
            name = paths.check_name(convert.text(body, "path", required=True), "path")
            ttl = convert.integer(body, "ttl_seconds")
            check_ttl(ttl)
            ages = convert.strings(body, "age_encryption_recipients") or []
            parse_recipients(ages)   # refused at once (400), as the SDK's other saves are
        except (EngineError, paths.PathError) as exc:
            raise front.refused(tenant, ref, "save_external", exc) from None
        work = self.rt.external.save(tenant, ref, name, ttl_seconds=ttl, recipients=ages)
        return await front.promise(tenant, rid, work, lambda row: {
            "type": "save_weights_external", "path": convert.tinker_path(row),
            "size_bytes": row.size_bytes})

    @route
    async def urls(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        params = request.path_params
        run_id = self.front.aliases.get((tenant, params["run_id"]), params["run_id"])
        ref = checkpoint_ref(paths.tinker_path(run_id, f"{params['segment']}/{params['name']}"),
                             "checkpoint_id")
        signed = self.rt.external.urls(tenant, ref)
        base = str(request.base_url).rstrip("/")
        return {"urls": {name: base + s.url for name, s in signed.paths.items()},
                "expires": convert._time(signed.expires)}

    @route
    async def download(self, request: Request) -> Any:
        params, query = request.path_params, request.query_params
        path = self.rt.external.open(params["run_id"], params["name"], params["file"],
                                     query.get("expires"), query.get("signature"),
                                     query.get("reader"))
        return FileResponse(path, media_type="application/octet-stream")

    @route
    async def upload_start(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        lora = convert._field(body, "lora_config", dict, required=True)
        started = await self.rt.imports.start(
            tenant, convert.text(body, "base_model", required=True), lora,
            convert.text(body, "destination_project_id"))
        base = str(request.base_url).rstrip("/")
        return {"upload_id": started.upload_id,
                "urls": {name: base + s.url for name, s in started.paths.items()},
                "expires": convert._time(started.expires)}

    @route
    async def upload(self, request: Request) -> Any:
        params, query = request.path_params, request.query_params
        size = await self.rt.imports.receive(
            params["upload_id"], params["file"], query.get("expires"),
            query.get("signature"), query.get("reader"), request.stream())
        return {"size_bytes": size}

    @route
    async def upload_finish(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        row = await self.rt.imports.finish(
            tenant, convert.text(body, "upload_id", required=True))
        return {"tinker_path": convert.tinker_path(row)}

    def routes(self) -> list[Route]:
        v1 = "/api/v1"
        table = [
            ("POST", f"{v1}/save_weights_external", self.save_weights_external),
            ("GET", f"{v1}/training_runs/{{run_id}}/checkpoints/{{segment}}/{{name}}"
                    "/external_weights_urls", self.urls),
            ("GET", f"{DOWNLOAD_PREFIX}/{{run_id}}/{{name}}/{{file}}", self.download),
            ("POST", f"{v1}/external_weights_upload_start", self.upload_start),
            ("PUT", f"{UPLOAD_PREFIX}/{{upload_id}}/{{file}}", self.upload),
            ("POST", f"{v1}/external_weights_upload_finish", self.upload_finish),
        ]
        return [Route(path, fn, methods=[method]) for method, path, fn in table]
