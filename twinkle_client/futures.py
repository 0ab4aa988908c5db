"""Futures for remote calls: returned at once, awaited in async code or read with result().

A call is started on the connection's thread pool the moment it is made, so a script can
submit many ops before waiting on any (the server orders them by seq_id). The future works
in three settings: a plain script (`.result()`), threads, and a running asyncio loop such
as a Jupyter cell (`await fut`). `.result()` on the loop's own thread blocks that thread
but cannot deadlock: the call runs on a pool thread that never needs the loop.

Cancelling (`fut.future().cancel()`) tells the truth about the call (`CallFuture`): one
still queued on the pool is never sent (the seq_ids it reserved are released, so the
model's later ops run); a started ordered op cannot be taken back, since the server
applies it in order, so cancel() is False; a started interruptible call (a sample) has its
gRPC call cancelled, and the server stops it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")

_pool_thread = threading.local()


class CallFuture(concurrent.futures.Future):
    """The `concurrent.futures.Future` of one call on a connection's pool; `run` runs it.

    Queued, it cancels as any future does, and the pool runs the call's `on_cancel` in its
    place (to release the seq_ids it reserved). Started, an ordinary call is RUNNING and
    cannot be cancelled; an `interruptible` one stays cancellable until it finishes: its
    gRPC call in flight (`attach`) is cancelled with it and its result is dropped.
    """

    def __init__(self, interruptible: bool = False) -> None:
        super().__init__()
        self.interruptible = interruptible
        self._started = False
        self._stop: Callable[[], Any] | None = None
        # Orders cancel() against the start of the call and the attaching of its gRPC call.
        self._lock = threading.RLock()

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
            on_cancel: Callable[[], Any] | None) -> None:
        """Run the call on this pool thread, or `on_cancel` if it was cancelled first."""
        if not self._start():
            if on_cancel is not None:
                on_cancel()
            return
        _pool_thread.call = self
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter unchanged
            self._settle(self.set_exception, exc)
        else:
            self._settle(self.set_result, result)
        finally:
            _pool_thread.call = None

    def _start(self) -> bool:
        with self._lock:
            if self.cancelled():
                return False
            self._started = True
            return self.interruptible or self.set_running_or_notify_cancel()

    def _settle(self, setter: Callable[[Any], None], value: Any) -> None:
        try:
            setter(value)
        except concurrent.futures.InvalidStateError:
            pass  # an interruptible call cancelled while it ran: its outcome is dropped

    def attach(self, stop: Callable[[], Any]) -> bool:
        """Make `stop` (a gRPC call's cancel) part of cancelling this call; False if the
        call is already cancelled, and the caller stops its gRPC call itself."""
        with self._lock:
            if self.cancelled():
                return False
            self._stop = stop
            return True

    def cancel(self) -> bool:
        with self._lock:
            if self.cancelled():
                return True
            if not super().cancel():     # started (and not interruptible), or finished
                return False
            self.set_running_or_notify_cancel()   # wakes `wait`/`as_completed` now
            stop, self._stop = self._stop, None
        if stop is not None:
            stop()
        return True

    def running(self) -> bool:
        return self._started and not self.done()


def running_call() -> CallFuture | None:
    """The call that this thread, a pool thread, is running now (None elsewhere)."""
    return getattr(_pool_thread, "call", None)


class _Then(concurrent.futures.Future):
    """The future of `fn(result)` of a call: cancelling it is cancelling that call."""

    def __init__(self, source: concurrent.futures.Future) -> None:
        super().__init__()
        self._source = source

    def cancel(self) -> bool:
        return self._source.cancel()    # on success, `Future.then`'s callback cancels this

    def running(self) -> bool:
        return self._source.running()


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
        """The underlying `concurrent.futures.Future`, for `wait`/`as_completed`; its
        cancel() cancels the call where it can (see the module)."""
        return self._future

    def add_done_callback(self, fn: Callable[[Future[T]], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def then(self, fn: Callable[[T], U]) -> Future[U]:
        """A future of `fn(result)`, computed when this one finishes (errors pass through);
        cancelling it cancels this call, and succeeds only if that does."""
        out = _Then(self._future)

        def chain(done: concurrent.futures.Future) -> None:
            if done.cancelled():
                concurrent.futures.Future.cancel(out)
                out.set_running_or_notify_cancel()
                return
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
        future = self._future
        if not future.done():
            state = "pending"
        elif future.cancelled():
            state = "cancelled"
        else:
            state = f"failed: {future.exception()!r}" if future.exception() else "done"
        return f"<{type(self).__name__} {state}>"
