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


@contextlib.contextmanager
def failing_forward(model, error: BaseException, when, times: int = 1) -> Iterator[list[int]]:
    """Inside the block, a forward of `model` whose `input_ids` satisfy `when(ids)` raises
    `error` (the first `times` such forwards), as running out of memory or a device error
    there would. Yields the list of failures so far, to assert the fault was hit."""
    hits: list[int] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and len(hits) < times and when(ids):
            hits.append(1)
            raise error

    handle = model.get_input_embeddings().register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield hits
    finally:
        handle.remove()
