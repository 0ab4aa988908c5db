"""Which ready ops run together: the scheduler's one decision, as a pure function.

The scheduler (`scheduling.scheduler`) keeps the queues and their order; each time its
worker is free it hands `plan_batch` the ready head of every queue, and runs the batch it
returns, within a token budget per merged pass that depends on the device; `plan_work`
picks between a training batch and a decode slice, and `plan_cancel` what becomes of an
op nobody waits for any more. No torch, no threads: tests call them directly. `Op`, what
they speak of, is defined here, so the scheduler imports this module and never the other
way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from twinkle_server.engine.errors import InvalidArgument

Mode = Literal["merged", "timeshare"]
MODES: tuple[str, ...] = ("merged", "timeshare")
Work = Literal["train", "decode"]
Place = Literal["queued", "joining", "pool", "running", "done"]
Cancel = Literal["keep", "drop", "skip", "stop"]

FORWARD = "forward"
"""Merge group of forward and forward_backward ops: one base pass for many."""
SAMPLE = "sample"
"""Merge group of sample ops: with the continuous sampler they join the decode pool;
with the static one, a batch of them is one run-to-completion decode."""
DEFAULT_DECODE_SLICE_S = 0.1
"""How long a decode slice runs before ready training ops get the worker
(`--decode-slice-ms`): what a training op waits, at most, while sampling runs."""
# Most tokens in one merged pass. Merging pays while one op's pass leaves the device
# underused. On a CPU that ends near 1k tokens: `python -m bench.engine`'s pass table
# measured a merged pass against the same ops one by one at 1.47x for 8 x 128 tokens and
# 1.19x for 4 x 256, but 0.90x for 2 x 1024 and 0.91x for 4 x 1024 (bigger passes fall
# out of cache). An accelerator's crossover is higher; 8192 is a starting point until
# one is measured.
CPU_TOKEN_BUDGET = 1024
ACCELERATOR_TOKEN_BUDGET = 8192
DEFAULT_TOKEN_BUDGET = CPU_TOKEN_BUDGET


@dataclass(frozen=True)
class Op:
    """One unit of work for the executor; `payload` is opaque to the scheduler.

    `seq_id` None means unordered: the op runs in arrival order and is not idempotent.
    `merge_group` names which ops may share a pass ('forward', 'sample'); None runs alone.
    `tokens` is the op's share of a merged pass's `token_budget`. `on_partial` hears each
    `Partial` a decode slice reports for the op before its result (called from the
    worker thread, outside the scheduler's lock). `tenant` and `bytes` (its payload's
    arrays) count against the scheduler's `QueueLimits` while it waits; an op with no
    tenant (the server's own) is never bounded. `adapter`: the adapter a merged op's pass
    needs resident (`Slots`), None for none.
    """

    queue_id: str
    seq_id: int | None
    kind: str
    merge_group: str | None
    tokens: int
    payload: Any
    request_id: str = ""
    on_partial: Callable[[Any], None] | None = field(default=None, compare=False)
    tenant: str | None = None
    bytes: int = 0
    adapter: str | None = None

    @classmethod
    def failed(cls, queue_id: str, seq_id: int | None, kind: str, error: BaseException,
               request_id: str = "") -> Op:
        """An op whose result is `error`: a request refused before it ran still takes its
        seq_id, so the queue's later ops are not left waiting for it."""
        def fail() -> Any:
            raise error
        return cls(queue_id, seq_id, kind, None, 0, fail, request_id)


@dataclass(frozen=True)
class Partial:
    """A decode slice's word on an op still decoding (a streamed sample's tokens so far):
    given to its `Op.on_partial`, and the op decodes on."""

    value: Any


def default_token_budget(device_type: str) -> int:
    """The merged-pass token budget for a device type ('cpu', 'cuda', ...)."""
    return CPU_TOKEN_BUDGET if device_type == "cpu" else ACCELERATOR_TOKEN_BUDGET


@dataclass(frozen=True)
class Slots:
    """The engine's adapter slots as a batch is planned: at most `limit` adapters are
    resident at once (`--max-adapters`), and `resident` are now."""

    limit: int
    resident: frozenset[str]


def plan_batch(heads: Sequence[Op], mode: str, token_budget: int,
               start_index: int = 0, slots: Slots | None = None) -> list[Op]:
    """Which of the ready heads (at most one per queue, in rotation order) run together now.

    The pass starts at `heads[start_index]` and wraps around, so moving `start_index`
    round-robin lets every queue lead in turn. The leading head always runs, even when it
    alone exceeds `token_budget`, so no op can be starved by its size. In `merged` mode,
    later heads of other queues join it when they share its (non-None) merge group and
    the batch stays within `token_budget`; a head that does not fit is skipped, and a
    smaller one after it may still join. In `timeshare` mode every batch is one op.

    With `slots`, a merged batch holds at most `slots.limit` adapters, so it runs as one
    pass (the engine runs a batch of more in passes one after another, each paging in its
    own), and the heads whose adapters are resident join before those that would page
    in: a batch pages in only what it cannot do without. The leading head joins whatever
    its adapter, so rotation still gives every queue its turn.

    Raises:
        InvalidArgument: `mode` is not 'merged' or 'timeshare', or `start_index` is
            outside `heads`.
    """
    if mode not in MODES:
        raise InvalidArgument(f"scheduling: {mode!r} is not one of {', '.join(MODES)}")
    if not heads:
        return []
    if not 0 <= start_index < len(heads):
        raise InvalidArgument(f"start_index: {start_index} is outside the {len(heads)} heads "
                              f"(0..{len(heads) - 1})")
    rotated = list(heads[start_index:]) + list(heads[:start_index])
    first = rotated[0]
    batch = [first]
    if mode == "timeshare" or first.merge_group is None:
        return batch
    tokens = first.tokens
    seen = {first.queue_id}
    adapters = {first.adapter} - {None}
    others = rotated[1:]
    if slots is not None:   # those that page nothing in first, each side in rotation order
        present = slots.resident | adapters
        others.sort(key=lambda op: op.adapter is not None and op.adapter not in present)
    for op in others:
        if op.merge_group != first.merge_group or op.queue_id in seen:
            continue
        if tokens + op.tokens > token_budget:
            continue
        new_adapter = op.adapter is not None and op.adapter not in adapters
        if slots is not None and new_adapter and len(adapters) >= slots.limit:
            continue
        batch.append(op)
        tokens += op.tokens
        seen.add(op.queue_id)
        if op.adapter is not None:
            adapters.add(op.adapter)
    return batch


def plan_work(training_ready: bool, decoding: bool, joining: bool, last: Work | None,
              training_first: bool) -> Work | None:
    """What the worker runs next when sampling is continuous: a training batch
    (`plan_batch` over the ready heads) or a decode slice.

    While rows are decoding (`decoding`) and training ops wait, the two alternate: a
    training op waits at most one decode slice, and a stream of training ops cannot
    starve sampling (it gets a slice after every training batch). With the pool idle and
    only new sample ops waiting (`joining`), the older work goes first: `training_first`,
    whether the oldest ready training op arrived before the oldest of them. Alone, either
    runs back to back. None: nothing to do.
    """
    if training_ready and decoding:
        return "decode" if last == "train" else "train"
    if training_ready and joining:
        return "train" if training_first else "decode"
    if training_ready:
        return "train"
    return "decode" if decoding or joining else None


def plan_cancel(decode_op: bool, place: Place, ordered: bool) -> Cancel:
    """What becomes of an op whose every caller stopped waiting (an HTTP future cancelled
    by the SDK's `cancel_future`, a gRPC client gone away).

    Only a decode op (a sample op of the continuous sampler's pool) is cancelled. It
    changes no state, so its result is its only effect, and it holds pool rows and KV for
    up to `max_tokens` steps that other requests wait for. Every other op runs (`keep`):
    a training op (forward_backward, optim_step, save, load) changes the model state its
    later seq_ids were built on, and a client that reconnects and retries its seq_id must
    find it done; a one-pass read (compute_logprobs) ends within one pass anyway. An op
    already running as a batch, or finished, is kept too.

    For a decode op:
    - `drop`: unordered and still queued, or taken off its queue but not yet in the pool
      (`joining`): answer `Cancelled` now; it never runs;
    - `skip`: ordered and still queued: answer `Cancelled` now; it still takes its seq_id
      in its turn (every seq_id is consumed, or the queue's later ops would wait forever);
    - `stop`: in the pool: the executor ends it at the next decode slice.
    """
    if not decode_op or place in ("running", "done"):
        return "keep"
    if place == "pool":
        return "stop"
    if place == "queued" and ordered:
        return "skip"
    return "drop"
