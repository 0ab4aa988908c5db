"""The routes of the SDK's `RestClient`: the tenant's training runs, checkpoints
(listing, deleting, publishing, expiry) and sessions, through `runtime.runs` (everything
scoped to the calling tenant; a checkpoint another tenant published is readable too).

The SDK puts a checkpoint id (`weights/<name>`, `sampler_weights/<name>`) into its URLs
as two path segments; routes name them `{segment}/{name}` (names never hold a '/'), so a
checkpoint named `publish` or `ttl` cannot be mistaken for the routes that end so.
A listing's cursor reports the limit its page was served with (`_cursor`), so the SDK's
paging goes on past a page cut to `MAX_PAGE`."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from twinkle_server.http import convert
from twinkle_server.http.app import Front, json_body, route
from twinkle_server.http.errors import BadBody
from twinkle_server.runtime import CheckpointRef, checkpoint_ref
from twinkle_server.runtime.runs import DEFAULT_PAGE, MAX_PAGE, run_switches
from twinkle_server.runtime.trace_exports import OPERATOR_PREFIX, TRACE_PREFIX
from twinkle_wire import paths


def _page_args(request: Request) -> tuple[int, int]:
    """The query's `limit` and `offset` (0: left out), each refused by name when it is
    not an integer in [0, 2^63)."""
    return (convert.query_integer(request.query_params, "limit"),
            convert.query_integer(request.query_params, "offset"))


def _cursor(limit: int, offset: int, total: int) -> dict[str, int]:
    """The SDK's `Cursor`, with the limit the page was served with (`limit` left out is
    `DEFAULT_PAGE`, one over `MAX_PAGE` is `MAX_PAGE`), not the one asked for: the SDK
    asks for the next page while `offset + limit < total_count`, so echoing a limit
    over the maximum would end its paging with rows never listed."""
    return {"offset": offset, "limit": min(limit or DEFAULT_PAGE, MAX_PAGE),
            "total_count": total}


class Rest:
    def __init__(self, front: Front) -> None:
        self.front = front
        self.rt = front.rt

    def _run_id(self, tenant: str, run_id: str) -> str:
        return self.front.aliases.get((tenant, run_id), run_id)

    @route
    async def list_runs(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        limit, offset = _page_args(request)
        page = self.rt.runs.list_runs(tenant, limit, offset)
        return {"training_runs": [convert.run(v) for v in page.items],
                "cursor": _cursor(limit, offset, page.total)}

    @route
    async def get_run(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        run_id = self._run_id(tenant, request.path_params["run_id"])
        return convert.run(self.rt.runs.get_run(tenant, run_id))

    @route
    async def run_checkpoints(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        run_id = self._run_id(tenant, request.path_params["run_id"])
        page = self.rt.runs.list_checkpoints(tenant, run_id, MAX_PAGE, 0)
        return {"checkpoints": [convert.checkpoint(row, run) for row, run in page.items]}

    @route
    async def list_checkpoints(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        limit, offset = _page_args(request)
        page = self.rt.runs.list_checkpoints(tenant, "", limit, offset)
        return {"checkpoints": [convert.checkpoint(row, run) for row, run in page.items],
                "cursor": _cursor(limit, offset, page.total)}

    def _ref(self, request: Request) -> tuple[str, CheckpointRef]:
        tenant = self.front.tenant(request)
        params = request.path_params
        run_id = self._run_id(tenant, params["run_id"])
        text = paths.tinker_path(run_id, f"{params['segment']}/{params['name']}")
        return tenant, checkpoint_ref(text, "checkpoint_id")

    @route
    async def delete_checkpoint(self, request: Request) -> Any:
        tenant, ref = self._ref(request)
        await self.rt.runs.delete_checkpoint(tenant, ref)
        return JSONResponse(None)

    @route
    async def publish_checkpoint(self, request: Request) -> Any:
        tenant, ref = self._ref(request)
        await self.rt.runs.publish_checkpoint(tenant, ref, public=request.method == "POST")
        return JSONResponse(None)

    @route
    async def set_checkpoint_ttl(self, request: Request) -> Any:
        tenant, ref = self._ref(request)
        body = await json_body(request)
        if "ttl_seconds" not in body:
            raise BadBody("ttl_seconds: required (null removes the expiry)")
        await self.rt.runs.set_checkpoint_ttl(tenant, ref, convert.integer(body, "ttl_seconds"))
        return JSONResponse(None)

    @route
    async def weights_info(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        ref = checkpoint_ref(convert.text(body, "tinker_path", required=True), "tinker_path")
        row, run = self.rt.runs.get_checkpoint(tenant, ref)
        lora = run.lora if run else {}
        return {"base_model": run.base_model if run else self.rt.bases.default.name,
                "is_lora": True, "lora_rank": lora.get("rank"), **run_switches(run)}

    # ------------------------------------------------------------------ sessions

    @route
    async def get_session(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        view = self.rt.runs.get_session(tenant, request.path_params["session_id"])
        return {"training_run_ids": view.run_ids, "sampler_ids": view.sampler_ids}

    @route
    async def trace_export(self, request: Request) -> Any:
        """Tinker's trace_export poll: built at once, so always `ready`."""
        tenant = self.front.tenant(request)
        signed = self.rt.trace_exports.export(tenant, request.path_params["session_id"])
        return {"status": "ready", "url": str(request.base_url).rstrip("/") + signed.url}

    @route
    async def trace_download(self, request: Request) -> Any:
        query = request.query_params
        path = self.rt.trace_exports.open(request.path_params["session_id"],
                                          query.get("expires"), query.get("signature"),
                                          query.get("reader"))
        return FileResponse(path, media_type="application/json")

    @route
    async def operator_trace(self, request: Request) -> Any:
        query = request.query_params
        data = self.rt.trace_exports.for_operator(request.path_params["session_id"],
                                                  query.get("expires"),
                                                  query.get("signature"))
        return Response(data, media_type="application/json")

    @route
    async def list_sessions(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        limit, offset = _page_args(request)
        page = self.rt.runs.list_sessions(tenant, limit, offset)
        return {"sessions": [row.session_id for row in page.items]}

    def routes(self) -> list[Route]:
        v1 = "/api/v1"
        checkpoint = "/training_runs/{run_id}/checkpoints/{segment}/{name}"
        table = [
            ("GET", "/training_runs", self.list_runs),
            ("GET", "/training_runs/{run_id}", self.get_run),
            ("GET", "/training_runs/{run_id}/checkpoints", self.run_checkpoints),
            ("DELETE", checkpoint, self.delete_checkpoint),
            ("POST", f"{checkpoint}/publish", self.publish_checkpoint),
            ("DELETE", f"{checkpoint}/publish", self.publish_checkpoint),
            ("PUT", f"{checkpoint}/ttl", self.set_checkpoint_ttl),
            ("GET", "/checkpoints", self.list_checkpoints),
            ("POST", "/weights_info", self.weights_info),
            ("GET", "/sessions", self.list_sessions),
            ("GET", "/sessions/{session_id}", self.get_session),
            ("GET", "/sessions/{session_id}/trace_export", self.trace_export),
        ]
        return [*(Route(v1 + path, fn, methods=[method]) for method, path, fn in table),
                Route(f"{TRACE_PREFIX}/{{session_id}}.json", self.trace_download,
                      methods=["GET"]),
                Route(f"{OPERATOR_PREFIX}/{{session_id}}", self.operator_trace,
                      methods=["GET"])]
