"""The scheduler's executor: turns a batch of ops into engine calls.

Ops of merge group `forward` carry a `ForwardRequest` and run as one merged
`Engine.forward_batch`; group `sample` carries `SampleRequest`s, which join the engine's
decode pool (`decode`, continuous batching) or, with the static sampler, run as one
`Engine.sample_batch`; every other op carries a zero-argument callable (optimizer step,
save, load, ...) run alone. Engine errors come back as values, one per op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twinkle_server.engine.errors import EngineError
from twinkle_server.engine.protocol import EngineAPI
from twinkle_server.engine.types import Generation
from twinkle_server.planning import FORWARD, SAMPLE, Op

__all__ = ["FORWARD", "SAMPLE", "EngineExecutor"]


class EngineExecutor:
    """Runs scheduler batches on one engine, from the scheduler's single worker thread."""

    def __init__(self, engine: EngineAPI) -> None:
        self.engine = engine
        # Sample ops in the decode pool, by the key the engine answers them under.
        self._waiting: dict[int, Op] = {}
        self._keys = 0

    def run_batch(self, ops: Sequence[Op]) -> Sequence[Any]:
        group = ops[0].merge_group
        if group == FORWARD:
            return self.engine.forward_batch([op.payload for op in ops])
        if group == SAMPLE:
            return [out if isinstance(out, EngineError) else Generation(out)
                    for out in self.engine.sample_batch([op.payload for op in ops])]
        results: list[Any] = []
        for op in ops:
            try:
                results.append(op.payload())
            except EngineError as exc:
                results.append(exc)
        return results

    def decode(self, joining: Sequence[Op], slice_s: float) -> list[tuple[Op, Any]]:
        """One decode slice with `joining` sample ops new to the pool; returns the sample
        ops finished (now or in earlier slices' rows) with their results."""
        waiting = self._waiting
        keys = []
        for op in joining:
            self._keys += 1
            waiting[self._keys] = op
            keys.append(self._keys)
        return [(waiting.pop(key), result) for key, result in
                self.engine.decode([op.payload for op in joining], keys, slice_s)]
