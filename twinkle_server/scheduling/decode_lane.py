"""The scheduler's decode lane: sample ops decoding continuously, beside the queues.

With a `decode_group` (the continuous sampler), ops of that merge group leave their
queue as soon as they are its ready head (`divert`) and join the executor's decode pool
(`Executor.decode`), where they decode in bounded slices, many requests at once, each
answered the slice it finishes. An unordered one (a sampling session's) frees its queue
at once, so every request of a session decodes together; an ordered one (a live
model's, by seq_id) holds its queue until answered, as any op does.

Between its queue and its answer an op is `joining` (taken off its queue, not yet handed
to the pool) and then `decoding` (in the pool). A cancelled one leaves the lane before
it joins the pool, or is `stopping`: the next slice ends it. Like `Queues`, the lane has
no lock of its own: the scheduler calls it with its lock held, and runs the slices.

An op in the pool has one key from its queue to its answer: its entry's arrival ticket
(`Entry.ticket`). The executor hands it to the engine, the engine's pool answers under
it, and the lane finds the entry by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from twinkle_server.scheduling.planning import Op, Partial, Place
from twinkle_server.scheduling.queues import Entry, Queue, Queues


class DecodeLane:
    """The sample ops between their queues and the decode pool.

    Args:
        group: the merge group whose ops decode continuously; None: no op does (they
            run as batches like any other group) and the lane stays empty.
    """

    def __init__(self, group: str | None) -> None:
        self.group = group
        # Decode ops taken from their queues: not yet handed to the pool, and in it (by key).
        self.joining: list[tuple[Queue, Entry]] = []
        self.decoding: dict[int, tuple[Queue, Entry]] = {}
        # Keys of ops in the pool whose callers went away: the next slice ends them.
        self.stopping: list[int] = []
        # Keys of ops failed with a slice that raised: the next slice has the pool drop
        # whatever of them it still holds.
        self._forgotten: list[int] = []
        self.slices_run = 0

    def takes(self, op: Op) -> bool:
        """Whether `op` decodes in the pool (a sample op of the continuous sampler)."""
        return self.group is not None and op.merge_group == self.group

    def divert(self, queues: Queues) -> bool:
        """Move every ready head of the decode group off its queue to join the pool; an
        unordered one leaves its queue free for the next. A cancelled ordered head was
        answered already: it only takes its seq_id. Returns whether any moved."""
        if self.group is None:
            return False
        moved, any_moved = True, False
        while moved:
            moved = False
            for queue in queues:
                head = queue.head()
                if head is None or head.op.merge_group != self.group:
                    continue
                moved = any_moved = True
                queue.pop_head(head)
                if head.op.seq_id is not None:
                    if head.cancelled:
                        queues.retire(queue, head)
                        continue
                    queue.running = head
                queues.started(head)
                self.joining.append((queue, head))
        return any_moved

    def first_ticket(self) -> int | None:
        """The arrival ticket of the oldest op joining, None when none is."""
        return min((e.ticket for _, e in self.joining), default=None)

    def stop(self, entry: Entry) -> None:
        """End `entry`, in the pool, at the next slice."""
        self.stopping.append(entry.ticket)

    def hand_over(self) -> tuple[list[tuple[Queue, Entry]], list[int]]:
        """The ops that join the pool in the next slice (now decoding), and the keys of
        the pool's ops that it must stop or drop."""
        joining, self.joining = self.joining, []
        for queue, entry in joining:
            self.decoding[entry.ticket] = queue, entry
        # One that finished since its cancel is no longer the pool's.
        stopping = self._forgotten + [key for key in self.stopping if key in self.decoding]
        self.stopping, self._forgotten = [], []
        return joining, stopping

    def finished(self, done: Sequence[tuple[int, Any]]
                 ) -> tuple[list[tuple[tuple[Queue, Entry], Any]], list[tuple[Entry, Partial]]]:
        """The entries a slice finished, each with its result, and the entries it
        reported a `Partial` for (they decode on); a key the lane does not hold (its op
        was answered already) is passed over."""
        self.slices_run += 1
        finished, partial = [], []
        for key, result in done:
            if key not in self.decoding:
                continue
            if isinstance(result, Partial):
                partial.append((self.decoding[key][1], result))
            else:
                finished.append((self.decoding.pop(key), result))
        return finished, partial

    def failed(self, error: Exception) -> list[tuple[tuple[Queue, Entry], Any]]:
        """Every entry in the pool, each with `error`: a slice that raised leaves the
        pool's state unknown, so the next slice has it drop them all."""
        finished = [(pair, error) for pair in self.decoding.values()]
        self._forgotten = list(self.decoding)
        self.decoding.clear()
        self.stopping.clear()
        self.slices_run += 1
        return finished

    def locate(self, future: Future) -> tuple[Place, Queue, Entry] | None:
        """Where in the lane the op of `future` is (in the pool or joining); None: not
        here."""
        for queue, entry in self.decoding.values():
            if entry.future is future:
                return "pool", queue, entry
        for queue, entry in self.joining:
            if entry.future is future:
                return "joining", queue, entry
        return None

    def entries(self) -> list[tuple[Place, Queue, Entry]]:
        """Every op in the lane, with where it is: in the pool or joining it."""
        return [*(("pool", queue, entry) for queue, entry in self.decoding.values()),
                *(("joining", queue, entry) for queue, entry in self.joining)]

    def take_joining(self) -> list[Entry]:
        """Remove and return the ops not yet handed to the pool."""
        joining, self.joining = [entry for _, entry in self.joining], []
        return joining

    def __len__(self) -> int:
        """The ops in the pool or joining it."""
        return len(self.decoding) + len(self.joining)
