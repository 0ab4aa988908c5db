"""Reading a tenant's audit log across UTC midnight: the log is read one UTC day at a
time (the SDK's `get_audit_log(day=...)`), and a test that runs past midnight has its
first entries in yesterday's log. A fresh-clone run at 00:00 UTC (2026-12-08) lost a
walk's `session_create` so."""

from __future__ import annotations

import datetime as dt
from typing import Any


def audit_days() -> tuple[dt.date, dt.date]:
    """Yesterday and today, UTC, in the order their entries were written."""
    today = dt.datetime.now(dt.timezone.utc).date()
    return today - dt.timedelta(days=1), today


def entries_since_yesterday(client: Any, **kwargs: Any) -> list:
    """The caller's entries of yesterday and today, oldest first, through any client whose
    `get_audit_log(day=..., event_type=...)` answers a future (the stock SDK's
    `AdminClient`, `tinker_compat.RestClient`)."""
    return [entry for day in audit_days()
            for entry in client.get_audit_log(day=day, **kwargs).result().entries]
