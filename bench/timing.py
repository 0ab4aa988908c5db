"""Side-by-side timing shared by the benchmarks: interleaved rounds, each path's best."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


def best_per_call(steps: Mapping[str, Callable[[], object]], rounds: int, calls: int = 1,
                  warmup: bool = False) -> dict[str, float]:
    """Seconds per call of each step. The steps alternate round by round (A B A B ...) so
    drift in the machine's load, and a warmer or colder allocator, hits all of them
    alike; each keeps its best round of `calls` calls (after one unmeasured call first
    when `warmup`)."""
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, fn in steps.items():
            if warmup:
                fn()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return best
