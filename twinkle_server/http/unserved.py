"""Routes of the Tinker API that this server does not provide, each answering with a
message that names the feature, instead of a bare "Not Found".

The status is 404, which the SDK raises at once as `tinker.NotFoundError`: it retries
408, 409, 429 and every 5xx for up to five minutes, so 501 would keep a caller waiting
for an answer that cannot change. No tenant is needed: what the server lacks is no
secret. Each call is logged, to show which missing features are asked for.

A request that carries a `seq_id` (with the `model_id` of one of the caller's models)
still consumes it, in order, before the 404: the SDK numbers every op of a training
client, and a number never consumed would leave the model's later ops waiting for it
forever. The same holds for a path no route matches at all (`not_found`), so an op a
newer SDK adds is answered 404 without stalling its model; a request with no seq_id
takes none.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from twinkle_server.engine.errors import EngineError, NotFound
from twinkle_server.http.app import Front, read_body
from twinkle_server.http.errors import BadBody, status_for

log = logging.getLogger("twinkle_server.http")
UNSERVED: tuple[tuple[str, str, str, str], ...] = (
    # method, path under /api/v1, the feature (the SDK method), what to do instead
    ("POST", "/retrieve_futures", "retrieve_futures (several futures in one request)",
     "retrieve each with retrieve_future"),
    ("POST", "/create_custom_loss", "create_custom_loss (server-side custom losses)",
     "forward_backward_custom computes a custom loss in the client"),
    ("POST", "/join_sampling_session", "join_sampling_session",
     "create a sampling client with ServiceClient.create_sampling_client"),
    ("PUT", "/sessions/{session_id}/project", "assign_session_project (projects)",
     "this server has tenants, not projects"),
    ("POST", "/sessions/search", "search_sessions", "list them with list_sessions"),
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


async def consume_seq(front: Front | None, request: Request, error: Exception) -> None:
    """Spend the request's `seq_id` with `error` as its result, in the order of the
    caller's model (`Front.refused`), when its body names one (`model_id` + `seq_id`) of
    a model the caller owns; anything else (no body, no seq_id, another tenant's model)
    takes nothing."""
    if front is None or request.method not in ("POST", "PUT", "DELETE", "PATCH"):
        return
    try:
        body = json.loads(await read_body(request) or b"{}")
    except (ValueError, BadBody):   # not JSON, or too large to read: no seq_id here
        return
    if not (isinstance(body, dict) and isinstance(body.get("model_id"), str)
            and isinstance(body.get("seq_id"), int)):
        return
    try:
        tenant = front.tenant(request)
        ref = front.op(tenant, body, front._id())
    except EngineError:
        return
    front.refused(tenant, ref, "unserved", error)


def _answer(feature: str, instead: str, front: Front | None
            ) -> Callable[[Request], Awaitable[Response]]:
    async def unserved(request: Request) -> Response:
        log.info("unserved route %s %s: %s", request.method, request.url.path, feature)
        error = NotFound(f"{feature}: not provided by this server; {instead}")
        await consume_seq(front, request, error)
        status, body, headers = status_for(error)
        return JSONResponse(body, status, headers)
    return unserved


def routes(front: Front | None = None) -> list[Route]:
    """One route per entry of `UNSERVED`; with `front`, each consumes a seq_id it carries."""
    return [Route("/api/v1" + path, _answer(feature, instead, front), methods=[method])
            for method, path, feature, instead in UNSERVED]


def not_found(front: Front) -> Callable[[Request, Exception], Awaitable[Response]]:
    """The app's answer to a path no route matches: 404, after consuming a seq_id the
    request carries (a route of a newer SDK)."""
    async def handler(request: Request, exc: Exception) -> Response:
        error = NotFound(f"{request.method} {request.url.path}: no such route on this server")
        await consume_seq(front, request, error)
        status, body, headers = status_for(error)
        return JSONResponse(body, status, headers)
    return handler
