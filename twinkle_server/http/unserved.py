"""Routes of the Tinker API that this server does not provide, each answering with a
message that names the feature, instead of a bare "Not Found".

The status is 404, which the SDK raises at once as `tinker.NotFoundError`: it retries
408, 409, 429 and every 5xx for up to five minutes, so 501 would keep a caller waiting
for an answer that cannot change. No tenant is needed: what the server lacks is no
secret. Each call is logged, to show which missing features are asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from twinkle_server.engine.errors import NotFound
from twinkle_server.http.errors import status_for

log = logging.getLogger("twinkle_server.http")
DOWNLOAD = "download checkpoints with twinkle_client's download_checkpoint (gRPC)"
UNSERVED: tuple[tuple[str, str, str, str], ...] = (
    # method, path under /api/v1, the feature (the SDK method), what to do instead
    ("POST", "/retrieve_futures", "retrieve_futures (several futures in one request)",
     "retrieve each with retrieve_future"),
    ("POST", "/copy_weights", "copy_weights (copying a checkpoint into a project)",
     "publish it (publish_checkpoint_from_tinker_path) to share it with other tenants"),
    ("POST", "/create_custom_loss", "create_custom_loss (server-side custom losses)",
     "forward_backward_custom computes a custom loss in the client"),
    ("POST", "/join_sampling_session", "join_sampling_session",
     "create a sampling client with ServiceClient.create_sampling_client"),
    ("POST", "/save_weights_external", "save_weights_external (external weights)", DOWNLOAD),
    ("GET", "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}/external_weights_urls",
     "get_external_weights_urls (signed download URLs)", DOWNLOAD),
    ("PUT", "/sessions/{session_id}/project", "assign_session_project (projects)",
     "this server has tenants, not projects"),
    ("GET", "/sessions/{session_id}/trace_export", "export_session_trace (session traces)",
     "the server's /metrics has per-op timings"),
    ("POST", "/sessions/search", "search_sessions", "list them with list_sessions"),
    ("GET", "/audit", "get_audit_log (audit log)", "the server's log records every op"),
    ("GET", "/billing/usage/events", "get_billing_usage (billing)", "this server bills nothing"),
    ("GET", "/billing/usage/checkpoints/current",
     "get_current_checkpoint_storage_usage (billing)",
     "list_user_checkpoints gives each checkpoint's size_bytes"),
    ("POST", "/auth/token", "access tokens (the SDK's JWT exchange, behind RestClient.whoami)",
     "requests authenticate with the API key itself; the tenant is the key's"),
    ("GET", "/auth/apikey/me", "API key self-service (tinker auth login)",
     "keys are made and revoked with `twinkle-server keys`"),
    ("DELETE", "/auth/apikey/me", "API key self-service (tinker auth logout)",
     "keys are made and revoked with `twinkle-server keys`"),
)


def _answer(feature: str, instead: str) -> Callable[[Request], Awaitable[Response]]:
    async def unserved(request: Request) -> Response:
        log.info("unserved route %s %s: %s", request.method, request.url.path, feature)
        status, body, headers = status_for(
            NotFound(f"{feature}: not provided by this server; {instead}"))
        return JSONResponse(body, status, headers)
    return unserved


def routes() -> list[Route]:
    """One route per entry of `UNSERVED`."""
    return [Route("/api/v1" + path, _answer(feature, instead), methods=[method])
            for method, path, feature, instead in UNSERVED]
