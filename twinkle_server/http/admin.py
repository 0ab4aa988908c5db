"""The SDK's `AdminClient.get_audit_log` (`GET /audit`) and `RestClient.copy_weights`
(`POST /copy_weights`), over `runtime.audit` and `runtime.copies`.

Neither carries a seq_id: both answer at once, not through a future. A copy's
`X-Idempotency-Key` (one per SDK call, kept across its retries) makes a retry answer the
first attempt's copy (a key over `MAX_IDEMPOTENCY_KEY_CHARS` is refused, never cut to
fit); `X-Tinker-Weights-Access-Token`, when sent, is another tenant's API
key, whose tenant reads the source (Twinkle's only access tokens are API keys).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from twinkle_server.http import convert
from twinkle_server.http.app import Front, json_body, route
from twinkle_server.http.errors import BadBody
from twinkle_server.runtime import checkpoint_ref
from twinkle_server.runtime.copies import MAX_IDEMPOTENCY_KEY_CHARS
from twinkle_server.store import AuditRow

IDEMPOTENCY_HEADER = "x-idempotency-key"
ACCESS_TOKEN_HEADER = "x-tinker-weights-access-token"


def audit_entry(row: AuditRow) -> dict[str, Any]:
    """An `AuditLogEntry`: the deprecated top-level fields are set on checkpoint events,
    as the SDK documents them."""
    details = dict(row.details)
    checkpoint = row.event.startswith("checkpoint_")
    return {"timestamp": datetime.fromtimestamp(row.at, timezone.utc).isoformat(),
            "event": row.event, "event_details": details,
            "model_id": details.get("model_id") if checkpoint else None,
            "tinker_path": details.get("tinker_path") if checkpoint else None,
            "purpose": details.get("purpose") if row.event == "checkpoint_read" else None}


class AdminRoutes:
    def __init__(self, front: Front) -> None:
        self.front = front
        self.rt = front.rt

    @route
    async def audit(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        rows = await self.rt.audit.entries(tenant, request.query_params.get("event_type", "all"),
                                     request.query_params.get("day", ""))
        return {"entries": [audit_entry(r) for r in rows]}

    @route
    async def copy_weights(self, request: Request) -> Any:
        tenant = self.front.tenant(request)
        body = await json_body(request)
        source = checkpoint_ref(convert.text(body, "source_path", required=True), "source_path")
        token = request.headers.get(ACCESS_TOKEN_HEADER)
        reader = self.rt.copies.reader_of(token) if token else None
        key = request.headers.get(IDEMPOTENCY_HEADER, "")
        if len(key) > MAX_IDEMPOTENCY_KEY_CHARS:
            raise BadBody(f"X-Idempotency-Key: {len(key)} characters, over the "
                          f"{MAX_IDEMPOTENCY_KEY_CHARS} a key may have (the SDK sends a "
                          "36-character UUID)")
        row = await self.rt.copies.copy(
            tenant, source, reader=reader, session_id=convert.text(body, "session_id") or None,
            ttl_seconds=convert.integer(body, "ttl_seconds"),
            destination=convert.text(body, "destination_project_id"), idempotency_key=key)
        return {"tinker_path": convert.tinker_path(row)}

    def routes(self) -> list[Route]:
        return [Route("/api/v1/audit", self.audit, methods=["GET"]),
                Route("/api/v1/copy_weights", self.copy_weights, methods=["POST"])]
