"""The scheduler's executor: turns a batch of ops into engine calls.

Ops of merge group `forward` carry a `ForwardRequest` and run as one merged
`Engine.forward_batch`; group `sample` carries `SampleRequest`s for one
`Engine.sample_batch`; every other op carries a zero-argument callable (optimizer step,
save, load, ...) run alone. Engine errors come back as values, one per op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from twinkle_server.engine.errors import EngineError
from twinkle_server.engine.protocol import EngineAPI
from twinkle_server.scheduler import Op

FORWARD = "forward"
SAMPLE = "sample"


class EngineExecutor:
    """Runs scheduler batches on one engine, from the scheduler's single worker thread."""

    def __init__(self, engine: EngineAPI) -> None:
        self.engine = engine

    def run_batch(self, ops: Sequence[Op]) -> Sequence[Any]:
        group = ops[0].merge_group
        if group == FORWARD:
            return self.engine.forward_batch([op.payload for op in ops])
        if group == SAMPLE:
            return self.engine.sample_batch([op.payload for op in ops])
        results: list[Any] = []
        for op in ops:
            try:
                results.append(op.payload())
            except EngineError as exc:
                results.append(exc)
        return results
