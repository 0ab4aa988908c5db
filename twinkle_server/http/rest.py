"""The routes of the SDK's `RestClient`: the tenant's training runs, checkpoints and
sessions, through `runtime.runs` (everything scoped to the calling tenant)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from twinkle_server.engine.errors import InvalidArgument, NotFound
from twinkle_server.http import convert
from twinkle_server.http.app import Front, checkpoint_ref, json_body, route
from twinkle_server.runtime.runs import MAX_PAGE


def _page_args(request: Request) -> tuple[int, int]:
    try:
        return (int(request.query_params.get("limit", 0) or 0),
                int(request.query_params.get("offset", 0) or 0))
    except ValueError:
        raise InvalidArgument("limit, offset: must be integers") from None


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
                "cursor": {"offset": offset, "limit": limit or len(page.items),
                           "total_count": page.total}}

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
        return {"checkpoints": [convert.checkpoint(row) for row, _ in page.items]}

    @route
    async def list_checkpoints(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        limit, offset = _page_args(request)
        page = self.rt.runs.list_checkpoints(tenant, "", limit, offset)
        return {"checkpoints": [convert.checkpoint(row) for row, _ in page.items],
                "cursor": {"offset": offset, "limit": limit or len(page.items),
                           "total_count": page.total}}

    def _ref(self, request: Request):
        tenant = self.front.tenant(request)
        run_id = self._run_id(tenant, request.path_params["run_id"])
        text = f"tinker://{run_id}/{request.path_params['checkpoint_id']}"
        return tenant, checkpoint_ref(text, "checkpoint_id")

    @route
    async def delete_checkpoint(self, request: Request) -> Any:
        tenant, ref = self._ref(request)
        await self.rt.runs.delete_checkpoint(tenant, ref)
        return JSONResponse(None)

    @route
    async def weights_info(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        ref = checkpoint_ref(convert.text(body, "tinker_path", required=True), "tinker_path")
        row, run = self.rt.runs.get_checkpoint(tenant, ref)
        lora = run.lora if run else {}
        return {"base_model": run.base_model if run else self.rt.config.model,
                "is_lora": True, "lora_rank": lora.get("rank")}

    # ------------------------------------------------------------------ sessions

    def _session_runs(self, tenant: str) -> dict[str, list[str]]:
        runs: dict[str, list[str]] = {}
        offset = 0
        while offset >= 0:
            page = self.rt.runs.list_runs(tenant, MAX_PAGE, offset)
            for view in page.items:
                if view.run.session_id:
                    runs.setdefault(view.run.session_id, []).append(view.run.run_id)
            offset = page.next_offset
        return runs

    @route
    async def get_session(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        session_id = request.path_params["session_id"]
        if self.rt.store.session_tenant(session_id) != tenant:
            raise NotFound(f"session_id: no session {session_id!r}")
        samplers = [s for s, e in self.rt.samplers.items()
                    if e.tenant == tenant and e.session_id == session_id]
        return {"training_run_ids": self._session_runs(tenant).get(session_id, []),
                "sampler_ids": samplers}

    @route
    async def list_sessions(self, request: Request) -> Any:
        """Sessions that own a run or a sampler: the store keeps no per-tenant session
        listing, so a session with neither is not listed."""
        tenant = self.front.tenant(request)
        limit, offset = _page_args(request)
        sessions = set(self._session_runs(tenant))
        sessions.update(e.session_id for e in self.rt.samplers.values()
                        if e.tenant == tenant and e.session_id)
        ordered = sorted(sessions)
        return {"sessions": ordered[offset:offset + (limit or len(ordered))]}

    def routes(self) -> list[Route]:
        v1 = "/api/v1"
        table = [
            ("GET", "/training_runs", self.list_runs),
            ("GET", "/training_runs/{run_id}", self.get_run),
            ("GET", "/training_runs/{run_id}/checkpoints", self.run_checkpoints),
            ("DELETE", "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}",
             self.delete_checkpoint),
            ("GET", "/checkpoints", self.list_checkpoints),
            ("POST", "/weights_info", self.weights_info),
            ("GET", "/sessions", self.list_sessions),
            ("GET", "/sessions/{session_id}", self.get_session),
        ]
        return [Route(v1 + path, fn, methods=[method]) for method, path, fn in table]
