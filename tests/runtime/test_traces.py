"""Session traces in memory: spans and counters in Chrome's trace-event form, a ring per
session and a cap on sessions, so what they hold is bounded."""

from __future__ import annotations

import json

from twinkle_server.runtime.traces import Traces


def _op(traces: Traces, session: str, at: float, track: str = "model run-1") -> None:
    traces.op(session, track, "forward_backward", at, at + 0.5, at + 1.0,
              {"tokens": 8}, {"queue depth": 3})


def test_an_op_leaves_a_queued_span_a_running_span_and_counters_on_its_track():
    traces = Traces()
    _op(traces, "s1", 10.0)
    traces.op("s1", "sampler samp-1", "sample", 11.0, None, 11.2, {}, {})
    events = json.loads(traces.export("s1"))["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    spans = [(e["name"], e["tid"], round(e["dur"])) for e in events if e["ph"] == "X"]
    assert spans == [("queued", names["model run-1"], 500_000),
                     ("forward_backward", names["model run-1"], 500_000),
                     ("sample", names["sampler samp-1"], 200_000)]   # never left its queue
    assert [e["args"] for e in events if e["ph"] == "C"] == [{"queue depth": 3}]


def test_a_session_keeps_its_last_events_and_the_server_its_last_sessions():
    traces = Traces(per_session=6, sessions=2)
    for i in range(5):
        _op(traces, "s1", float(i))          # 3 events an op: the first three ops go
    events = json.loads(traces.export("s1"))["traceEvents"]
    assert [e["ts"] for e in events if e["name"] == "forward_backward"] == [
        traces._us(3.5), traces._us(4.5)]
    _op(traces, "s2", 0.0)
    _op(traces, "s1", 9.0)                   # s1 active again: s2 is the oldest
    _op(traces, "s3", 0.0)
    assert "s1" in traces and "s3" in traces and "s2" not in traces
    assert json.loads(traces.export("s2"))["traceEvents"][1:] == []


def test_a_running_total_becomes_its_rate_since_the_sessions_previous_op():
    traces = Traces()
    traces.op("s1", "t", "sample", 0.0, 0.0, 1.0, {}, {}, {"decode tokens": 100})
    traces.op("s1", "t", "sample", 1.0, 1.0, 3.0, {}, {}, {"decode tokens": 500})
    rates = [e["args"] for e in json.loads(traces.export("s1"))["traceEvents"]
             if e["ph"] == "C"]
    assert rates == [{"decode tokens/s": 200.0}]     # (500 - 100) / (3 - 1); none at first
