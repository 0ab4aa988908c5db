"""Futures for remote calls: returned at once, awaited in async code or read with result().

A call is started on the connection's thread pool the moment it is made, so a script can
submit many ops before waiting on any (the server orders them by seq_id). The future works
in three settings: a plain script (`.result()`), threads, and a running asyncio loop such
as a Jupyter cell (`await fut`). `.result()` on the loop's own thread blocks that thread
but cannot deadlock: the call runs on a pool thread that never needs the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class Future(Generic[T]):
    """The result of a remote call, now or later.

    Example:
        fut = model.forward_backward(batch)   # returns at once
        out = fut.result()                   # or, in async code: out = await fut
    """

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    @classmethod
    def completed(cls, value: T) -> Future[T]:
        """A future that already holds `value`."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(value)
        return cls(done)

    def result(self, timeout: float | None = None) -> T:
        """Block until the call finishes; raise its exception, or TimeoutError."""
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        """Await the call without blocking the event loop; TimeoutError after `timeout` s.

        A timeout stops the wait, not the call: the op still runs on the server in order.
        """
        wrapped = asyncio.shield(asyncio.wrap_future(self._future))
        if timeout is None:
            return await wrapped
        return await asyncio.wait_for(wrapped, timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The call's exception (None if it succeeded), waiting up to `timeout` s."""
        return self._future.exception(timeout)

    def future(self) -> concurrent.futures.Future:
        """The underlying `concurrent.futures.Future`, for `wait`/`as_completed`."""
        return self._future

    def add_done_callback(self, fn: Callable[[Future[T]], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def then(self, fn: Callable[[T], U]) -> Future[U]:
        """A future of `fn(result)`, computed when this one finishes (errors pass through)."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def chain(done: concurrent.futures.Future) -> None:
            try:
                out.set_result(fn(done.result()))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter unchanged
                out.set_exception(exc)

        self._future.add_done_callback(chain)
        return type(self)(out)

    async def coroutine(self) -> T:
        """This future as a coroutine, for `asyncio.create_task`."""
        return await self

    def __repr__(self) -> str:
        state = "pending" if not self.done() else (
            f"failed: {self.exception()!r}" if self.exception() else "done")
        return f"<{type(self).__name__} {state}>"
