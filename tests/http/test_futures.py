"""The HTTP front's futures table (twinkle_server/http/futures.py): what a tenant may park
in it, counted as the refusal says, and how long an answered result stays readable."""

from __future__ import annotations

import asyncio

import pytest

from twinkle_server.engine.errors import NotFound, ResourceExhausted
from twinkle_server.http import futures
from twinkle_server.http.futures import Futures


async def _done(value: int) -> int:
    return value


def _submit_finished(table: Futures, tenant: str, request_id: str) -> None:
    table.submit(tenant, request_id, _done(1), lambda result: result)


async def _settle() -> None:
    for _ in range(3):   # the tasks run, then their done callbacks
        await asyncio.sleep(0)


async def _run_and_read(table: Futures, tenant: str, request_ids: list[str]) -> None:
    """Each request in turn submitted, finished and its result read."""
    for request_id in request_ids:
        _submit_finished(table, tenant, request_id)
        await _settle()
        table.answered(table.get(tenant, request_id))


def test_read_results_do_not_count_against_the_tenants_bound(monkeypatch):
    """A tenant that reads every result never meets the bound, however many ops it runs
    within the results' lifetime; unread ones still count, and the refusal names them."""
    monkeypatch.setattr(futures, "MAX_FUTURES_PER_TENANT", 3)

    async def scenario() -> None:
        table = Futures()
        await _run_and_read(table, "alice", [f"r{i}" for i in range(10)])
        for i in range(3):
            _submit_finished(table, "alice", f"unread{i}")
        with pytest.raises(ResourceExhausted, match=r"3 requests of this tenant are "
                                                    r"unfinished or unread \(at most 3\)"):
            _submit_finished(table, "alice", "one-too-many")
        _submit_finished(table, "bob", "b0")   # another tenant's bound is its own
        table.answered(table.get("alice", "unread0"))
        _submit_finished(table, "alice", "room-again")
        await _settle()
        table.close()

    asyncio.run(scenario())


def test_answered_results_past_the_kept_number_are_forgotten_oldest_first(monkeypatch):
    """Answered results stay readable (a client re-reads after a dropped connection), but
    a tenant keeps at most `KEPT_ANSWERED_PER_TENANT` of them: what they hold is bounded."""
    monkeypatch.setattr(futures, "KEPT_ANSWERED_PER_TENANT", 2)

    async def scenario() -> None:
        table = Futures()
        await _run_and_read(table, "alice", [f"r{i}" for i in range(4)])
        _submit_finished(table, "alice", "next")
        await _settle()
        for gone in ("r0", "r1"):
            with pytest.raises(NotFound, match=gone):
                table.get("alice", gone)
        assert table.get("alice", "r2").task.result() == 1
        assert table.get("alice", "r3").task.result() == 1
        table.close()

    asyncio.run(scenario())
