"""The scheduler's queues: `seq_id` order, idempotent retries, arrival order.

Each training model (and each sampling session) has a queue. An ordered op (one with a
`seq_id`) runs only after every lower `seq_id` of its queue has finished, whatever order
the RPCs arrive in; a retried `seq_id` gets the stored result (the op's future) without
running again. Unordered ops run in arrival order, interleaved with the ordered ones by
arrival (`Entry.ticket`). A queue has at most one op in flight (`Queue.running`), so
two ops of one queue never share a batch and an `optim_step` never overtakes its
model's `forward_backward`.

`Queues` is every queue in registration order, with the rotation cursor that lets each
lead a batch in turn. It has no lock of its own: the scheduler calls it with its lock
held. No threads, no torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from twinkle_server.engine.errors import (
    FailedPrecondition,
    InvalidArgument,
    NamesSeqIds,
    NotFound,
    ResourceExhausted,
    SeqIdInvalid,
    Unavailable,
)
from twinkle_server.scheduling.planning import Op, Place

# How far ahead of the next expected seq an op may arrive: bounds what one client can park
# in server memory while an earlier seq_id is missing.
MAX_SEQ_AHEAD = 1024
DEFAULT_RESULT_CACHE_SIZE = 256


@dataclass(frozen=True)
class QueueLimits:
    """How much may wait on one served model (queued, or sampling in its decode pool),
    for one tenant and for all tenants together: ops, and their payloads' bytes
    (`Op.bytes`: datums and prompts as arrays). Past a bound a new op is refused at once
    (`ResourceExhausted`, naming the flag) and takes nothing, so the client may send it
    again; an op that fills its queue's gap (the seq_id the queue runs next) is always
    taken, since what waits behind it cannot run without it, and so is an op whose
    bytes alone pass a bound when nothing else waits (a single large op still runs).
    The server's come from its flags (`FLAGS`, with their defaults)."""

    tenant_ops: int
    tenant_bytes: int
    model_ops: int
    model_bytes: int

    def __post_init__(self) -> None:
        for name in ("tenant_ops", "tenant_bytes", "model_ops", "model_bytes"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{FLAGS[name]}: {getattr(self, name)} must be at "
                                      "least 1")

    def refusal(self, op: Op, waiting: Iterable[Op]) -> ResourceExhausted | None:
        """Why `op` may not wait beside `waiting` (every op now waiting on the model),
        or None."""
        if op.tenant is None:
            return None
        ops = size = tenant_ops = tenant_size = 0
        for other in waiting:
            if other.tenant is None:
                continue
            ops, size = ops + 1, size + other.bytes
            if other.tenant == op.tenant:
                tenant_ops, tenant_size = tenant_ops + 1, tenant_size + other.bytes
        for name, whose, held, limit in (
                ("tenant_ops", "this tenant has", tenant_ops, self.tenant_ops),
                ("model_ops", "all tenants have", ops, self.model_ops)):
            if held + 1 > limit:
                return ResourceExhausted(
                    f"{FLAGS[name]}: {whose} {held} ops waiting on this model (queued or "
                    f"sampling), the most it allows; send this {op.kind} again as they "
                    "finish")
        for name, whose, held, limit in (
                ("tenant_bytes", "this tenant's", tenant_size, self.tenant_bytes),
                ("model_bytes", "all tenants'", size, self.model_bytes)):
            if held and held + op.bytes > limit:    # alone, any op may wait
                return ResourceExhausted(
                    f"{FLAGS[name]}: {whose} ops waiting on this model (queued or "
                    f"sampling) hold {held} bytes, and this {op.kind}'s {op.bytes} would "
                    f"pass {limit}; send it again as they finish")
        return None


FLAGS = {"tenant_ops": "--max-queued-ops-per-tenant",
         "tenant_bytes": "--max-queued-bytes-per-tenant",
         "model_ops": "--max-queued-ops", "model_bytes": "--max-queued-bytes"}
"""The server flag that sets each of `QueueLimits`' bounds, which its errors name."""


class SchedulerClosed(Unavailable):
    """The server is shutting down; the op was not run."""


class OutOfOrder(NamesSeqIds, FailedPrecondition):
    """The op's seq_id can never run (too old and forgotten, too far ahead, or reused)."""


class UnknownQueue(NotFound):
    """No model or sampling session with this id is registered."""


class OpFuture(Future):
    """A future its caller cannot cancel.

    An ordered op keeps its place even when the caller stops waiting (an RPC cancelled
    by a disconnect cancels its `wrap_future`): later seq_ids of the queue wait on it, and
    a retry of the same seq_id shares this future and must get the real result. A caller
    that stops waiting says so with `Scheduler.cancel`, which decides what to stop.

    What the scheduler did with the op, for its trace: `started` (`time.monotonic()`
    when it left its queue to run or to join the decode pool; None: never) and `tenants`
    (how many tenants' ops its pass carried; 0: it ran in no pass, as a decoded sample).
    """

    started: float | None = None
    tenants: int = 0
    op: Op | None = None
    """The op this is the future of (`Scheduler.submit`): a retry of its seq_id, given
    this future, is another op."""

    def cancel(self) -> bool:
        return False


@dataclass(eq=False)
class Entry:
    """One submitted op, its future, and what its queue knows of it."""

    op: Op
    future: OpFuture
    # Arrival number: orders a queue's ordered and unordered ops against each other.
    ticket: int
    arrived: float = field(default_factory=time.monotonic)
    # Callers sharing the future (retries of its seq_id): cancelled when all went away.
    waiters: int = 1
    # Answered `Cancelled`; an ordered one still takes its seq_id in its turn.
    cancelled: bool = False


@dataclass(eq=False)
class Queue:
    """One model's or sampling session's ops: waiting (ordered by seq_id, or unordered
    by arrival), the one running, and the finished ones kept for retries."""

    next_seq: int
    pending: dict[int, Entry] = field(default_factory=dict)
    unordered: deque[Entry] = field(default_factory=deque)
    running: Entry | None = None
    done: OrderedDict[int, Entry] = field(default_factory=OrderedDict)

    def head(self) -> Entry | None:
        """The op this queue would run next, or None while one runs or none is ready."""
        if self.running is not None:
            return None
        ordered = self.pending.get(self.next_seq)
        loose = self.unordered[0] if self.unordered else None
        if ordered is None or loose is None:
            return ordered or loose
        return ordered if ordered.ticket < loose.ticket else loose

    def pop_head(self, head: Entry) -> None:
        """Take `head` (what `head()` returned) off the waiting ops."""
        if head.op.seq_id is None:
            self.unordered.popleft()
        else:
            del self.pending[head.op.seq_id]

    def waiting(self) -> list[Entry]:
        """Every op not yet running: ordered by seq_id, then unordered by arrival."""
        return [*self.pending.values(), *self.unordered]

    def take_waiting(self) -> list[Entry]:
        """Remove and return every op not yet running."""
        waiting = self.waiting()
        self.pending.clear()
        self.unordered.clear()
        return waiting


class Queues:
    """Every queue, in registration order; call each method with the scheduler's lock.

    Args:
        result_cache_size: finished results kept per queue for retried seq_ids.
    """

    def __init__(self, result_cache_size: int) -> None:
        self.result_cache_size = result_cache_size
        self._queues: dict[str, Queue] = {}
        self._order: list[str] = []
        self._cursor = 0
        self._tickets = 0
        # Per op kind: ops started, and their seconds from arrival to start, summed.
        self.waits: dict[str, list[float]] = {}

    def __iter__(self) -> Iterator[Queue]:
        """The queues in registration order."""
        return (self._queues[queue_id] for queue_id in self._order)

    def register(self, queue_id: str, next_seq: int) -> None:
        """Create the queue `queue_id` unless it exists (then it is kept as it is)."""
        if queue_id not in self._queues:
            self._queues[queue_id] = Queue(next_seq=next_seq)
            self._order.append(queue_id)

    def unregister(self, queue_id: str) -> list[Entry]:
        """Forget a queue; returns its ops not yet running (none for an unknown id)."""
        queue = self._queues.pop(queue_id, None)
        if queue is None:
            return []
        index = self._order.index(queue_id)
        del self._order[index]
        # Keep the rotation pointing at the same next queue.
        if index < self._cursor:
            self._cursor -= 1
        return queue.take_waiting()

    def next_seq(self, queue_id: str) -> int:
        """The seq_id the queue runs next.

        Raises:
            UnknownQueue: no such queue.
        """
        queue = self._queues.get(queue_id)
        if queue is None:
            raise UnknownQueue(_unknown(queue_id))
        return queue.next_seq

    def admit(self, op: Op, fut: OpFuture,
               room: Callable[[Op], Exception | None] = lambda op: None
               ) -> Exception | OpFuture | None:
        """Queue `op` under `fut` (None), name why not, or return the future it shares.
        `room` says why a new op may not wait (its bounds), unless it fills its queue's
        gap; a retry of a seq_id already taken is never refused by it."""
        queue = self._queues.get(op.queue_id)
        if queue is None:
            return UnknownQueue(_unknown(op.queue_id))
        if op.tokens < 0:
            return InvalidArgument(f"tokens: {op.tokens} must be at least 0")
        self._tickets += 1
        entry = Entry(op, fut, self._tickets)
        if op.seq_id is None:
            if (error := room(op)) is not None:
                return error
            queue.unordered.append(entry)
            return None
        seq = op.seq_id
        running = queue.running if queue.running and queue.running.op.seq_id == seq else None
        existing = queue.done.get(seq) or running or queue.pending.get(seq)
        if existing is not None:
            if existing.op.kind != op.kind:
                return OutOfOrder(
                    f"seq_id: {{seq}} was already used by a {existing.op.kind} op; this "
                    f"{op.kind} needs a new seq_id (the model expects {{expected}})",
                    seq=seq, expected=queue.next_seq)
            if not existing.future.done():
                existing.waiters += 1
            return existing.future
        if seq < 0:
            return SeqIdInvalid("seq_id: {seq} must be at least {first}; the model "
                                "expects seq_id {expected} next",
                                seq=seq, first=0, expected=queue.next_seq)
        if seq < queue.next_seq:
            return OutOfOrder(
                "seq_id: {seq} already ran and its result is no longer kept; the model "
                "expects seq_id {expected} next", seq=seq, expected=queue.next_seq)
        if seq > queue.next_seq + MAX_SEQ_AHEAD:
            return OutOfOrder(
                f"seq_id: {{seq}} is more than {MAX_SEQ_AHEAD} ahead of the expected "
                "{expected}", seq=seq, expected=queue.next_seq)
        if seq != queue.next_seq and (error := room(op)) is not None:
            return error
        queue.pending[seq] = entry
        return None

    def ready_heads(self) -> tuple[list[Entry], int]:
        """Ready heads in registration order, and the index of the first one at or after
        the rotation cursor."""
        heads = []
        start = None
        for i, queue_id in enumerate(self._order):
            head = self._queues[queue_id].head()
            if head is not None:
                if start is None and i >= self._cursor:
                    start = len(heads)
                heads.append(head)
        return heads, start or 0

    def run(self, heads: list[Entry]) -> list[tuple[Queue, Entry]]:
        """Mark the ready `heads` of one batch running, each with its queue; the queue
        after the first one's leads the next rotation."""
        chosen = []
        for entry in heads:
            queue = self._queues[entry.op.queue_id]
            queue.pop_head(entry)
            queue.running = entry
            self.started(entry)
            chosen.append((queue, entry))
        self._cursor = (self._order.index(heads[0].op.queue_id) + 1) % len(self._order)
        return chosen

    def started(self, entry: Entry) -> None:
        """Count `entry`'s op started, and its seconds from arrival to now."""
        now = entry.future.started = time.monotonic()
        wait = self.waits.setdefault(entry.op.kind, [0, 0.0])
        wait[0] += 1
        wait[1] += now - entry.arrived

    def retire(self, queue: Queue, entry: Entry) -> None:
        """The op is over: free its queue, and an ordered one takes its seq_id (kept for
        retries). `queue` may be unregistered by now; updating the orphan is harmless."""
        if queue.running is entry:
            queue.running = None
        seq = entry.op.seq_id
        if seq is not None:
            queue.next_seq = seq + 1
            if self.result_cache_size:
                queue.done[seq] = entry
                while len(queue.done) > self.result_cache_size:
                    queue.done.popitem(last=False)

    def locate(self, future: Future) -> tuple[Place, Queue, Entry] | None:
        """Where in the queues the op of `future` is, running or queued; None: not here."""
        for queue in self._queues.values():
            if queue.running is not None and queue.running.future is future:
                return "running", queue, queue.running
            for entry in (*queue.pending.values(), *queue.unordered):
                if entry.future is future:
                    return "queued", queue, entry
        return None

    def queued(self) -> list[tuple[Place, Queue, Entry]]:
        """Every op still queued, with its queue."""
        return [("queued", queue, entry) for queue in self._queues.values()
                for entry in (*queue.pending.values(), *queue.unordered)]

    def take_waiting(self) -> list[Entry]:
        """Remove and return every queue's ops not yet running."""
        return [entry for queue in self._queues.values() for entry in queue.take_waiting()]

    def depths(self) -> dict[str, int]:
        """Each queue's ops not yet running."""
        return {q: len(v.pending) + len(v.unordered) for q, v in self._queues.items()}

    def running(self) -> int:
        """How many queues have an op running."""
        return sum(v.running is not None for v in self._queues.values())


def _unknown(queue_id: str) -> str:
    return f"model_id: no model or sampling session {queue_id!r} is registered"
