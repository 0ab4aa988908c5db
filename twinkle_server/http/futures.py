"""The futures table: what `retrieve_future` answers for each op the SDK was promised.

Every op route starts its runtime verb as an asyncio task on the server's one loop and
answers at once with `{"request_id": ...}`; the scheduler still orders the op by its
`seq_id` and dedupes retries. This table only remembers the task per tenant, so a
tenant can never read another's future, and forgets it `FUTURE_TTL_SECONDS` after it
finished, or sooner once read, past `KEPT_ANSWERED_PER_TENANT` read ones. `retrieve` long-polls: it waits up to `LONG_POLL_SECONDS` for the task before
answering "try again", because the SDK re-polls a try-again at once, without a pause.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from twinkle_server.engine.errors import NotFound, ResourceExhausted

FUTURE_TTL_SECONDS = 30 * 60
"""A finished future's result stays readable this long: the SDK reads it once, but may
read it again after a dropped connection, and a slow client may come late."""
MAX_FUTURES_PER_TENANT = 4096
"""How many unfinished or unread futures one tenant may park in server memory. The SDK
keeps at most a few hundred ops in flight per client (its byte semaphores), so 4096 leaves
room for many clients. Read ones do not count: a loop that reads every result may run any
number of ops within `FUTURE_TTL_SECONDS`."""
KEPT_ANSWERED_PER_TENANT = 4096
"""Read futures a tenant keeps readable, the oldest forgotten first past it: what read
results hold in memory is bounded too."""
LONG_POLL_SECONDS = 20.0
"""Under the SDK's 45 s `retrieve_future` timeout, so a pending op answers try-again in
time; long enough that a waiting client costs one request per op, not a busy loop."""


@dataclass
class Entry:
    task: asyncio.Task
    render: Callable[[Any], Any]      # the verb's result -> the response body
    finished_at: float | None = None
    answered: bool = False            # `retrieve_future` has given its outcome


def _finished(entry: Entry, task: asyncio.Task) -> None:
    entry.finished_at = time.monotonic()
    if not task.cancelled():
        task.exception()  # read here; `retrieve_future` reports it to the client


class Futures:
    def __init__(self) -> None:
        self._tables: dict[str, OrderedDict[str, Entry]] = {}

    def __len__(self) -> int:
        return sum(len(t) for t in self._tables.values())

    def pending(self) -> int:
        return sum(1 for t in self._tables.values() for e in t.values() if not e.task.done())

    def submit(self, tenant: str, request_id: str, work: Awaitable[Any],
               render: Callable[[Any], Any]) -> asyncio.Task:
        """Start `work` as the tenant's future `request_id`; returns its task. Refuses (without starting it)
        when the tenant already holds `MAX_FUTURES_PER_TENANT` unfinished or unread
        futures."""
        table = self._tables.setdefault(tenant, OrderedDict())
        self._sweep(table)
        unread = sum(1 for entry in table.values() if not entry.answered)
        if unread >= MAX_FUTURES_PER_TENANT:
            if hasattr(work, "close"):
                work.close()
            raise ResourceExhausted(
                f"futures: {unread} requests of this tenant are unfinished or unread "
                f"(at most {MAX_FUTURES_PER_TENANT}); retrieve their results first")
        entry = Entry(asyncio.ensure_future(work), render)
        entry.task.add_done_callback(lambda task: _finished(entry, task))
        table[request_id] = entry
        return entry.task

    def forget(self, tenant: str, request_id: str) -> None:
        """Drop the future `request_id` (an op refused at once: nobody will read it)."""
        self._tables.get(tenant, {}).pop(request_id, None)

    def get(self, tenant: str, request_id: str) -> Entry:
        entry = self._tables.get(tenant, {}).get(request_id)
        if entry is None:
            raise NotFound(f"request_id: no future {request_id!r} (unknown, or forgotten "
                           f"{FUTURE_TTL_SECONDS} s after it finished)")
        return entry

    def answered(self, entry: Entry) -> None:
        """`retrieve_future` gave the entry's outcome: it stays readable, but no longer
        counts against its tenant's bound."""
        entry.answered = True

    async def wait(self, entry: Entry, timeout: float = LONG_POLL_SECONDS) -> bool:
        """Whether the entry's task finished within `timeout` seconds."""
        if not entry.task.done():
            await asyncio.wait([entry.task], timeout=timeout)
        return entry.task.done()

    def unanswered(self, since: float) -> int:
        """Futures that finished at or after `since` (a `time.monotonic()`) and whose
        outcome no `retrieve_future` has given yet."""
        return sum(1 for table in self._tables.values() for e in table.values()
                   if e.finished_at is not None and e.finished_at >= since
                   and not e.answered)

    def cancel(self, tenant: str, request_id: str) -> None:
        """Stop waiting for the op (`cancel_future`): a sample op leaves its queue or the
        decode pool at the next step (`Core.run`); any other op still runs, in its turn."""
        self.get(tenant, request_id).task.cancel()

    def _sweep(self, table: OrderedDict[str, Entry]) -> None:
        """Forget the expired futures, and the oldest read ones past the number kept."""
        cutoff = time.monotonic() - FUTURE_TTL_SECONDS
        for request_id in [r for r, e in table.items()
                           if e.finished_at is not None and e.finished_at < cutoff]:
            del table[request_id]
        read = [r for r, e in table.items() if e.answered]
        for request_id in read[:max(0, len(read) - KEPT_ANSWERED_PER_TENANT)]:
            del table[request_id]

    def close(self) -> None:
        for table in self._tables.values():
            for entry in table.values():
                entry.task.cancel()
