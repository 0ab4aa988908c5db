"""How the scheduler's ops are answered: a batch's results made one per op whatever the
executor does, each future answered with its result or failure, partial results passed
to their listeners, and the errors of an op cancelled or of an executor that raised
something other than an `Exception`. Called outside the scheduler's lock: answering a
future runs its callers' callbacks."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from twinkle_server.engine.errors import Cancelled, CancelledOp
from twinkle_server.scheduling.planning import Op, Partial
from twinkle_server.scheduling.queues import Entry

log = logging.getLogger(__name__)


def batch_results(executor: Any, ops: Sequence[Op]) -> list[Any]:
    """`executor.run_batch(ops)`'s results, one per op; whatever it does (raise,
    return too few or no sequence) becomes per-op values."""
    n = len(ops)
    try:
        raw = executor.run_batch(ops)
    except Exception as exc:
        return [exc] * n
    except BaseException as exc:  # the worker outlives even SystemExit from an op
        return [wrapped(exc)] * n
    try:
        results = list(raw)
    except TypeError:
        error = RuntimeError(f"executor: run_batch returned {type(raw).__name__}, not "
                             f"a sequence of {n} results")
        return [error] * n
    if len(results) != n:
        kinds = ", ".join(op.kind for op in ops)
        error = RuntimeError(f"executor: run_batch returned {len(results)} results for "
                             f"{n} ops ({kinds}); none of them is trusted")
        return [error] * n
    return results


def answer(entries: Sequence[Entry], results: Sequence[Any]) -> None:
    """Answer each entry's future with its result: an exception as a failure (a
    `BaseException` wrapped, so that it never escapes into a caller), a cancelled op's
    `Cancelled` saying why; a future already answered is left as it is."""
    for entry, result in zip(entries, results, strict=True):
        if entry.future.done():
            continue
        if entry.cancelled and isinstance(result, Cancelled):
            result = cancelled(entry.op, result)   # why, and what a retry gets
        if isinstance(result, Exception):
            entry.future.set_exception(result)
        elif isinstance(result, BaseException):
            entry.future.set_exception(wrapped(result))
        else:
            entry.future.set_result(result)


def tell(entry: Entry, partial: Partial) -> None:
    """Give `partial` to its op's listener; one that raises harms no other op."""
    if entry.op.on_partial is None or entry.future.done():
        return
    try:
        entry.op.on_partial(partial.value)
    except Exception:
        log.exception("%s: its partial-result listener raised; the op decodes on",
                      entry.op.kind)


def cancelled(op: Op, cause: BaseException | None = None) -> Cancelled:
    what = (f"{op.kind}: cancelled before it finished: its caller stopped waiting "
            "(cancel_future, or the client went away)")
    error = Cancelled(what) if op.seq_id is None else CancelledOp(
        what + " (seq_id {seq} is taken: a retry of it gets this answer)", seq=op.seq_id)
    error.__cause__ = cause
    return error


def wrapped(exc: BaseException) -> RuntimeError:
    """A non-`Exception` (SystemExit, KeyboardInterrupt) must not escape into callers."""
    error = RuntimeError(f"executor: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def fail_all(entries: list[Entry], exc: BaseException) -> None:
    for entry in entries:
        if not entry.future.done():
            entry.future.set_exception(exc)
