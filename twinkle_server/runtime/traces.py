"""Session traces: what happened to each op of a session, as Perfetto opens it.

Every op of a session's models and samplers (`Core.run`) leaves, when it ends, a span for
the time it waited in its queue and one for the time it ran, on a track per model or
sampling session, with its tokens, bytes in and out, outcome, how many tenants' ops its
pass carried (never whose) and, for a sample, how many decode slices it rode in; beside
them, counter tracks of the served model's queue depth, decode-pool KV positions in use
and adapter page-ins, read at the same moment, and its decode tokens/s since the
session's previous op. Events are Chrome's
trace-event JSON, which ui.perfetto.dev opens (`export`).

Memory is bounded: each session keeps its last `MAX_EVENTS_PER_SESSION` events (a ring),
and the server its last `MAX_SESSIONS` sessions traced (the least recently active is
forgotten first). A trace lives in memory only: a restart starts with none.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from typing import Any

MAX_EVENTS_PER_SESSION = 4096
"""About 700 ops of a session: up to six events each (two spans, three counter samples
and a rate); about 2 MiB in memory (`python -m bench.traces` measures a full ring)."""
MAX_SESSIONS = 64
"""Sessions traced at once: about 130 MiB of events with every ring full."""
_PROCESS = 1


class Traces:
    """Each session's recent events, and the tracks they are drawn on."""

    def __init__(self, per_session: int = MAX_EVENTS_PER_SESSION,
                 sessions: int = MAX_SESSIONS) -> None:
        self.per_session, self.sessions = per_session, sessions
        self._events: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()
        self._tracks: dict[str, dict[str, int]] = {}
        self._totals: dict[str, tuple[float, dict[str, float]]] = {}
        # Ops are timed on the monotonic clock; traces show wall-clock microseconds.
        self._wall = time.time() - time.monotonic()

    def op(self, session: str, track: str, kind: str, submitted: float,
           started: float | None, finished: float, args: dict[str, Any],
           counters: dict[str, float], totals: dict[str, float] | None = None) -> None:
        """Record one ended op of `session` on `track` (its model or sampler): queued
        from `submitted` to `started` (None: it never left its queue), running from then
        to `finished` (monotonic seconds), with `args`; `counters` as they stood; and for
        each of `totals` (a running total, such as tokens decoded) its rate per second
        since this session's previous op, as a counter named `<name>/s`."""
        counters = dict(counters)
        last = self._totals.get(session)
        for name, total in (totals or {}).items():
            if last is not None and finished > last[0] and name in last[1]:
                counters[f"{name}/s"] = (total - last[1][name]) / (finished - last[0])
        if totals:
            self._totals[session] = (finished, dict(totals))
        events = self._ring(session)
        tid = self._track(session, track)
        begin = submitted if started is None else started
        if started is not None and started > submitted:
            events.append(self._span("queued", submitted, started, tid, {"op": kind}))
        events.append(self._span(kind, begin, finished, tid, args))
        for name, value in counters.items():
            events.append({"name": name, "ph": "C", "pid": _PROCESS, "tid": 0,
                           "ts": self._us(finished), "args": {name: value}})

    def __contains__(self, session: str) -> bool:
        return session in self._events

    def export(self, session: str) -> bytes:
        """`session`'s trace as Chrome trace-event JSON (no events: an empty trace)."""
        names = [{"name": "process_name", "ph": "M", "pid": _PROCESS, "tid": 0,
                  "args": {"name": f"twinkle session {session}"}}]
        names += [{"name": "thread_name", "ph": "M", "pid": _PROCESS, "tid": tid,
                   "args": {"name": track}}
                  for track, tid in self._tracks.get(session, {}).items()]
        events = list(self._events.get(session, ()))
        return json.dumps({"traceEvents": names + events, "displayTimeUnit": "ms"}).encode()

    def _ring(self, session: str) -> deque[dict[str, Any]]:
        events = self._events.get(session)
        if events is None:
            events = self._events[session] = deque(maxlen=self.per_session)
            while len(self._events) > self.sessions:
                forgotten, _ = self._events.popitem(last=False)
                self._tracks.pop(forgotten, None)
                self._totals.pop(forgotten, None)
        else:
            self._events.move_to_end(session)
        return events

    def _track(self, session: str, track: str) -> int:
        tracks = self._tracks.setdefault(session, {})
        return tracks.setdefault(track, len(tracks) + 1)

    def _span(self, name: str, begin: float, end: float, tid: int,
              args: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "ph": "X", "pid": _PROCESS, "tid": tid, "ts": self._us(begin),
                "dur": max(0.0, (end - begin) * 1e6), "args": args}

    def _us(self, monotonic: float) -> float:
        return (monotonic + self._wall) * 1e6
