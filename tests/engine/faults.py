"""Faults injected into the engine's own code paths, for tests of what survives them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from twinkle_server.engine import forward


@contextlib.contextmanager
def failing_replay(error: type[BaseException], nth: int = 2) -> Iterator[None]:
    """Inside the block, the `nth` replay with grad of a piece of a pass (counted over the
    block) raises `error`, as running out of memory there would."""
    real, replays = forward.PassLogprobs._run, []

    def failing(self, rows, grad):
        if grad:
            replays.append(1)
            if len(replays) == nth:
                raise error("the piece's replay ran out of memory")
        return real(self, rows, grad)

    forward.PassLogprobs._run = failing
    try:
        yield
    finally:
        forward.PassLogprobs._run = real
