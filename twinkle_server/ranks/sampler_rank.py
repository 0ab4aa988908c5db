"""A sampler rank: a whole copy of one served model's base, its own decode pool, and the
trained adapter weights rank 0 publishes to it in memory.

A model served with `sampler_ranks = K` (`model_table`) trains on its first ranks and
samples on its last K (`twinkle_server.ranks.split` is rank 0's side). Each sampler rank talks
to rank 0 over two gloo channels of their own (a `Link`):

- `weights`: publications, each an adapter's LoRA tensors under a routing key with a
  version (`Publication`), and releases. A thread receives them into the `Inbox` while the
  pool decodes; the serving thread makes them live between decode slices, never within
  one, so no step reads half-written weights.
- `calls`: decode slices and prompt scoring, each answered on the same channel. Every
  request names the key and the version it needs (`Need`): it starts only once that
  version (or, for a mutable key, a later one) is live on this rank (the publish gate).
  Until then it waits here, never running on the weights that were live before.

Prefix-cache entries are keyed by the weights' version (`Sampling._namespace`), so no
cached prompt crosses versions.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import Cancelled, EngineError, Unavailable
from twinkle_server.engine.types import LoraSpec, SampleRequest
from twinkle_server.ranks.channel import Channel

log = logging.getLogger(__name__)

NOOP, STOP = "noop", "stop"
PUBLISH, RELEASE = "publish", "release"
DECODE, SCORE = "decode", "score"


@dataclass(frozen=True)
class Link:
    """Rank 0 and one sampler rank (`rank`, the job's): the channel of its calls and the
    channel of the weights published to it, each a gloo group of the two."""

    rank: int
    calls: Channel
    weights: Channel


class Need(NamedTuple):
    """The weights a request routes to (`key`, None for the base) and the least version of
    them it may start on."""

    key: str | None
    version: int


@dataclass(frozen=True)
class Publication:
    """An adapter's LoRA tensors (PEFT keys) as routing key `key` at `version`. Tensors
    travel as raw bytes with their dtype and shape, so any float dtype goes as it is."""

    key: str
    version: int
    spec: LoraSpec
    tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = field(repr=False)

    @classmethod
    def of(cls, key: str, version: int, spec: LoraSpec,
           tensors: dict[str, torch.Tensor]) -> Publication:
        packed = {}
        for name, tensor in tensors.items():
            host = tensor.detach().to("cpu").contiguous()
            packed[name] = (str(host.dtype).removeprefix("torch."), tuple(host.shape),
                            host.reshape(-1).view(torch.uint8).numpy().copy())
        return cls(key, version, spec, packed)

    @property
    def nbytes(self) -> int:
        return sum(raw.nbytes for _, _, raw in self.tensors.values())

    def torch_tensors(self) -> dict[str, torch.Tensor]:
        return {name: torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)
                for name, (dtype, shape, raw) in self.tensors.items()}


class Inbox:
    """Publications and releases received, not yet live: filled by the receiving thread,
    applied in order by the serving thread (`apply`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: deque[tuple] = deque()
        self.refused: dict[str, tuple[int, EngineError]] = {}
        """Key -> the last version refused or let go, and why: requests needing it (or an
        earlier one) get the error instead of waiting."""

    def put(self, message: tuple) -> None:
        with self._cond:
            self._pending.append(message)
            self._cond.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` s for something to apply; whether there is."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._pending), timeout)

    def apply(self, engine: Engine) -> None:
        """Make everything received live on `engine`, in the order it was published. A
        publication the engine refuses (tensors not of the spec's shape) is logged and
        leaves the key as it was: requests needing it wait, then fail."""
        while True:
            with self._cond:
                if not self._pending:
                    return
                message = self._pending.popleft()
            if message[0] == PUBLISH:
                found: Publication = message[1]
                try:
                    engine.sampling.install(found.key, found.version, found.spec,
                                            found.torch_tensors())
                    self.refused.pop(found.key, None)
                except EngineError as exc:
                    log.error("publication %s v%d refused: %s", found.key, found.version, exc)
                    self.refused[found.key] = (found.version, exc)
            else:
                _, key, reason = message
                # Requests for the version let go (or an earlier one) fail with why; a
                # later publication of the key is a new version, which they may wait for.
                self.refused[key] = (engine.sampling.versions.get(key, 0), reason)
                engine.sampling.release(key, reason)

    def refusal(self, need: Need) -> EngineError | None:
        """Why `need`'s version will never be live here, if its publication was refused."""
        found = self.refused.get(need.key) if need.key is not None else None
        return found[1] if found is not None and found[0] >= need.version else None


def live(engine: Engine, need: Need) -> bool:
    """Whether `need`'s weights are live on `engine` (the base always is)."""
    return need.key is None or engine.sampling.versions.get(need.key, 0) >= need.version


@dataclass(eq=False)
class _Held:
    """A request waiting for its weights, under its key, since when."""

    request: SampleRequest
    key: int
    need: Need
    since: float


class SamplerRank:
    """The serving side of one sampler rank: decode slices and prompt scoring on `engine`
    behind the publish gate. `wait_s` bounds how long a request waits for its weights:
    rank 0 posts them before the request, so only a failing link keeps them away; it is
    under the collective timeout (half of it), so a score waiting on them is answered
    before rank 0 would give this rank up."""

    def __init__(self, engine: Engine, link: Link, wait_s: float) -> None:
        self.engine, self.link, self.wait_s = engine, link, wait_s
        self.inbox = Inbox()
        self.held: list[_Held] = []

    def decode(self, requests: Sequence[SampleRequest], keys: Sequence[int],
               needs: Sequence[Need], slice_s: float, cancelled: Sequence[int]
               ) -> list[tuple[int, Any]]:
        """One slice: new requests join once their weights are live, the others wait."""
        now = time.monotonic()
        self.held += [_Held(r, k, n, now) for r, k, n in zip(requests, keys, needs,
                                                              strict=True)]
        gone = {h.key for h in self.held} & set(cancelled)   # cancelled while waiting
        done: list[tuple[int, Any]] = [
            (key, Cancelled("sampling: the request was cancelled")) for key in gone]
        self.held = [h for h in self.held if h.key not in gone]
        self.inbox.apply(self.engine)
        pool = self.engine.sampling.pool
        idle = pool is not None and not pool.rows and not pool.waiting
        if self.held and idle and not any(live(self.engine, h.need) for h in self.held):
            # Nothing to decode until a publication lands: wait for it, a slice at most.
            self.inbox.wait(slice_s)
            self.inbox.apply(self.engine)
        ready, waiting = [], []
        for held in self.held:
            error = self.inbox.refusal(held.need)
            if error is not None:
                done.append((held.key, error))
            elif live(self.engine, held.need):
                ready.append(held)
            elif now - held.since > self.wait_s:
                done.append((held.key, self._never_arrived(held.need)))
            else:
                waiting.append(held)
        self.held = waiting
        done += self.engine.decode([h.request for h in ready], [h.key for h in ready],
                                   slice_s, [k for k in cancelled if k not in gone])
        return done

    def score(self, need: Need, tokens: np.ndarray, scoring: Any) -> Any:
        """Prompt scoring on `need`'s weights, once they are live."""
        deadline = time.monotonic() + self.wait_s
        self.inbox.apply(self.engine)
        while not live(self.engine, need):
            if (error := self.inbox.refusal(need)) is not None:
                raise error
            if not self.inbox.wait(max(0.0, deadline - time.monotonic())):
                raise self._never_arrived(need)
            self.inbox.apply(self.engine)
        return self.engine.score_prompt(need.key, None, tokens, scoring)

    def _never_arrived(self, need: Need) -> Unavailable:
        return Unavailable(f"sampling: sampler rank {self.link.rank} waited {self.wait_s:g} s "
                           f"for version {need.version} of {need.key!r}, which never arrived")

    def receive_weights(self) -> None:
        """The weights channel, until rank 0 says stop (on its own thread)."""
        while True:
            message = self.link.weights.receive()
            if message[0] == STOP:
                return
            if message[0] != NOOP:
                self.inbox.put(message)

    def serve(self) -> None:
        """The calls channel, until rank 0 says stop; raises when the link fails (the
        process must then exit non-zero)."""
        failed: list[BaseException] = []

        def receive() -> None:
            try:
                self.receive_weights()
            except BaseException as exc:
                failed.append(exc)

        receiver = threading.Thread(target=receive, daemon=True,
                                    name=f"twinkle-weights-{self.link.rank}")
        receiver.start()
        calls, rank = self.link.calls, self.link.rank
        while True:
            message = calls.receive()
            if failed:
                raise failed[0]
            kind = message[0]
            if kind == STOP:
                receiver.join(self.wait_s)
                return
            if kind == NOOP:
                continue
            try:
                if kind == DECODE:
                    reply: tuple = ("ok", self.decode(*message[1:]))
                elif kind == SCORE:
                    reply = ("ok", self.score(*message[1:]))
                else:
                    raise RuntimeError(f"rank 0 sent {kind!r}, not a sampler rank call")
            except EngineError as exc:
                reply = ("error", exc)
            calls.send((*reply, self.engine.decode_stats()), src=rank)
