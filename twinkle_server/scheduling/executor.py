"""The scheduler's executor: turns a batch of ops into engine calls.

Ops of merge group `forward` carry a `ForwardRequest` and run as one merged
`Engine.forward_batch`; group `sample` carries `SampleRequest`s, which join the engine's
decode pool (`decode`, continuous batching) or, with the static sampler, run as one
`Engine.sample_batch`; every other op carries a zero-argument callable (optimizer step,
save, load, ...) run alone. Engine errors come back as values, one per op. Sample ops
the scheduler cancels leave the pool at the next slice (`decode`'s `cancelled`).

A model's step never applies gradients a failed forward_backward left partial. The SDK
cuts a large forward_backward into chunks, each its own op: when one fails (refused,
or failing in its pass), the others still add theirs. So when, since the model's last
step, a forward_backward failed and another added gradients, its next `optim_step` is
refused instead (`FailedPrecondition`, naming the failure), and its gradients are
zeroed: nothing of that window is applied, and the step after starts clean. A window
whose only forward_backward failed holds no gradient of it, and steps as usual.
`zero_grad` or a `load_state` clears the window as well. The native `step` is left to
its own accumulation window (it applies every `gradient_accumulation_steps`-th call,
and zeroing is its loop's `zero_grad` at a window's end).

Served models that share a device take `Turns` on it: each batch or decode slice runs
while its model holds the device, first come first served.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

from twinkle_server.engine.errors import EngineError, FailedPrecondition
from twinkle_server.engine.protocol import EngineAPI
from twinkle_server.engine.types import Generation, Progress
from twinkle_server.scheduling.planning import FORWARD, SAMPLE, Op, Partial

__all__ = ["FORWARD", "SAMPLE", "EngineExecutor"]

STEPS = frozenset({"optim_step"})
"""Op kinds that apply a model's accumulated gradients at once (Tinker's step)."""
CLEARS = frozenset({"zero_grad", "load_state"})
"""Op kinds after which a model holds no gradients of an earlier op."""


class Turns:
    """One device's turns among the workers of the models placed on it, first come first
    served: a worker holds the device for one batch or one decode slice, then queues
    behind any other that waits. Computing at once, two models contend for the device
    (on a CPU, two thread teams on the same cores): a student's forward_backward ran
    1.81x slower while a teacher on the same 2 cores decoded, against 1.14x when the same
    load decoded in the student's own pool between its passes (BENCHMARKS.md, "Several
    base models"). Taking turns, a model's op waits at most one batch or slice of the
    others', as it would behind its own decode slices."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: deque[object] = deque()
        self._held = False

    def __enter__(self) -> None:
        me = object()
        with self._cond:
            self._waiting.append(me)
            self._cond.wait_for(lambda: not self._held and self._waiting[0] is me)
            self._waiting.popleft()
            self._held = True

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()


class _Alone:
    """The turns of a model alone on its device: always its own."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class EngineExecutor:
    """Runs scheduler batches on one engine, from the scheduler's worker thread; with
    `turns`, only while its model holds the device it shares. `decodes_here` False: the
    engine decodes on devices of its own (sampler ranks), so decode slices take no turn."""

    def __init__(self, engine: EngineAPI, turns: Turns | None = None,
                 decodes_here: bool = True) -> None:
        self.engine = engine
        self.turns = turns if turns is not None else _Alone()
        self.decode_turns = self.turns if decodes_here else _Alone()
        self._failed: dict[str, BaseException] = {}
        """Per model (queue id): the forward_backward that failed since its last step."""
        self._trained: set[str] = set()
        """The models a forward_backward added gradients to since their last step."""

    def run_batch(self, ops: Sequence[Op]) -> Sequence[Any]:
        try:
            with self.turns:
                results = self._run_batch(ops)
        except Exception as exc:   # every op of the batch fails with it
            self._note_failures(ops, [exc] * len(ops))
            raise
        self._note_failures(ops, results)
        return results

    def _note_failures(self, ops: Sequence[Op], results: Sequence[Any]) -> None:
        for op, result in zip(ops, results, strict=True):
            if op.kind != "forward_backward":
                continue
            if isinstance(result, BaseException):
                self._failed[op.queue_id] = result
            else:
                self._trained.add(op.queue_id)

    def _run_batch(self, ops: Sequence[Op]) -> Sequence[Any]:
        group = ops[0].merge_group
        if group == FORWARD:
            return self.engine.forward_batch([op.payload for op in ops])
        if group == SAMPLE:
            return [out if isinstance(out, EngineError) else Generation(out)
                    for out in self.engine.sample_batch([op.payload for op in ops])]
        results: list[Any] = []
        for op in ops:
            try:
                if op.kind in STEPS:
                    self._step_window(op)
                results.append(op.payload())
            except EngineError as exc:
                results.append(exc)
            if op.kind in CLEARS:
                self._failed.pop(op.queue_id, None)
                self._trained.discard(op.queue_id)
        return results

    def _step_window(self, op: Op) -> None:
        """End the model's window at the step `op`; if a forward_backward in it failed
        beside others that added gradients, zero them and refuse the step."""
        failure = self._failed.pop(op.queue_id, None)
        trained = op.queue_id in self._trained
        self._trained.discard(op.queue_id)
        if failure is None or not trained:
            return
        self.engine.zero_grad(op.queue_id)
        raise FailedPrecondition(
            f"{op.kind}: a forward_backward since the last step failed ({failure}); the "
            "gradients accumulated since then were dropped and nothing was applied: send "
            "the batch again, then step")

    def decode(self, joining: Sequence[tuple[int, Op]], slice_s: float,
               cancelled: Sequence[int] = ()) -> list[tuple[int, Any]]:
        """One decode slice with `joining` sample ops new to the pool, each under the key
        the scheduler gave it, and the keys of `cancelled` ones to end; returns the keys
        of the sample ops finished (now or in earlier slices' rows) with their results,
        a cancelled one's `Cancelled`, and a streamed one still decoding with its
        `Progress` as a `Partial`. The engine's pool answers under the same keys."""
        with self.decode_turns:
            done = self.engine.decode([op.payload for _, op in joining],
                                      [key for key, _ in joining], slice_s,
                                      cancelled=list(cancelled))
        return [(key, Partial(result) if isinstance(result, Progress) else result)
                for key, result in done]
