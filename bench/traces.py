"""What session traces cost (`runtime.traces`): the time `Core.run` spends leaving one
ended op in its session's trace (its spans, and counter samples of the served model's
queue depth, decode pool, page-ins and decode tokens/s read at that moment), against the
fastest ordered op a
client can send (`bench.server`'s GetTrainConfigs, about 1 ms p50 over loopback on 2 CPU
cores), and what a full ring of one session holds once exported.

Run: `.venv/bin/python -m bench.traces`. It runs in this process on the tiny engine's
runtime (no server); figures measure and print, nothing passes or fails on time.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from twinkle_server.config.flags import ServerConfig
from twinkle_server.engine.engine import Engine
from twinkle_server.runtime import ModelEntry, Runtime
from twinkle_server.scheduling.planning import FORWARD, Op
from twinkle_server.scheduling.queues import OpFuture
from twinkle_server.store import Store

CALLS = 20_000


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = ServerConfig(data_dir=Path(tmp))
        engine = Engine.load("tiny", device="cpu")
        store = Store(Path(tmp))
        rt = Runtime(config, engine, store)
        served = next(iter(rt.bases))
        rt.models["run-bench"] = ModelEntry("run-bench", "alice", "sess-bench", "tiny")
        op = Op("run-bench", 0, "forward_backward", FORWARD, 256, None, tenant="alice",
                bytes=4096)
        future = OpFuture()
        future.set_result(None)
        future.started, future.tenants = time.monotonic(), 2
        per_call = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(CALLS // 5):
                rt._trace(op, served, time.monotonic(), future, None, None)
            per_call.append((time.perf_counter() - start) / (CALLS // 5))
        exported = rt.traces.export("sess-bench")
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        rt.models["run-fill"] = ModelEntry("run-fill", "alice", "sess-fill", "tiny")
        fill = Op("run-fill", 0, "forward_backward", FORWARD, 256, None, tenant="alice")
        for _ in range(rt.traces.per_session):      # more than the ring holds
            rt._trace(fill, served, time.monotonic(), future, None, None)
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        rt.models["run-count"] = ModelEntry("run-count", "alice", "sess-count", "tiny")
        count = Op("run-count", 0, "forward_backward", FORWARD, 256, None, tenant="alice")
        for _ in range(10):
            rt._trace(count, served, time.monotonic(), future, None, None)
        events = json.loads(rt.traces.export("sess-count"))["traceEvents"]
        per_op = sum(e["ph"] != "M" for e in events) / 10
        print(f"session traces: {statistics.median(per_call) * 1e6:.1f} us to trace one "
              f"ended op (median of 5 runs of {CALLS // 5} calls; runs "
              f"{', '.join(f'{p * 1e6:.1f}' for p in per_call)} us)")
        print(f"  a full ring ({rt.traces.per_session} events, about "
              f"{rt.traces.per_session / max(per_op, 1):.0f} ops) holds {held / 2**20:.2f} MiB in memory "
              f"(measured by tracemalloc while a new session fills it) and exports as "
              f"{len(exported) / 2**20:.2f} MiB of JSON; at most {rt.traces.sessions} sessions "
              f"are kept: {held * rt.traces.sessions / 2**20:.0f} MiB at most")
        rt.close()
        store.close()


if __name__ == "__main__":
    main()
