"""Tinker's futures over Twinkle's: every call returns one at once.

`APIFuture` is both a `twinkle_client.futures.Future` (result, result_async, await, done,
exception, future) and a `tinker.APIFuture`, so `isinstance(f, tinker.APIFuture)` and
annotations in user code hold. As in tinker, cancelling `future()`, or an await that times
out or is cancelled, cancels the call where it can: not yet sent, it is never sent; a
running sample stops on the server; a training op already sent stays applied (cancel()
is False). `SampleFuture`, of `sample` and `compute_logprobs`, is also a
`concurrent.futures.Future`, as tinker 0.38's. `ClientFuture` is what the `create_*`
methods return, as in tinker 0.38: a future of a client that may also be used,
deprecated with a FutureWarning, as the client itself (`client_future(TrainingClient)`
builds the forwarding class).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import warnings
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import tinker

from twinkle_client.futures import Future

T = TypeVar("T")
C = TypeVar("C")
F = TypeVar("F", bound=Callable[..., Any])


class APIFuture(Future[T], tinker.APIFuture[T]):
    """The result of a remote call, now or later.

    Example:
        future = training_client.forward_backward(data, "cross_entropy")
        result = future.result()          # or, in async code: result = await future
    """

    @classmethod
    def failed(cls, error: BaseException) -> APIFuture[Any]:
        """A future that already holds `error` (a request refused before it was sent)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_exception(error)
        return cls(done)

    async def result_async(self, timeout: float | None = None) -> T:
        """Await the call; TimeoutError after `timeout` s. As in tinker, a timeout (or a
        cancelled await) cancels the call where it can (see the module)."""
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)


class SampleFuture(concurrent.futures.Future, APIFuture[T]):
    """The future of `sample` and `compute_logprobs`: an `APIFuture` that is also a
    `concurrent.futures.Future`, as tinker 0.38's `_AwaitableFutureCompatWrapper`, since
    both returned one before. Its state mirrors the call's, so `wait`, `as_completed` and
    `asyncio.wrap_future` see it finish; its Future methods warn once with tinker's
    FutureWarning, pointing to `.future()`."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        concurrent.futures.Future.__init__(self)
        self._future = future
        self._warned = False
        future.add_done_callback(self._mirror)

    def _mirror(self, future: concurrent.futures.Future) -> None:
        if future.cancelled():
            if concurrent.futures.Future.cancel(self):
                self.set_running_or_notify_cancel()
        elif (exception := future.exception()) is not None:
            self.set_exception(exception)
        else:
            self.set_result(future.result())

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    def future(self) -> concurrent.futures.Future:
        return self._future

    def __await__(self) -> Generator[Any, None, T]:
        return APIFuture.__await__(self)

    def __repr__(self) -> str:
        return APIFuture.__repr__(self)

    def _warn(self, method: str) -> None:
        # Once per future, as tinker's: the stdlib bridges call these from callbacks too.
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"DEPRECATED: .{method}() on this future uses a temporary compatibility wrapper "
            "for tinker's APIFuture, which a subsequent release removes. Await the future "
            "or call .result(); if you need a concurrent.futures.Future, call .future().",
            FutureWarning, stacklevel=3)

    def cancel(self) -> bool:
        self._warn("cancel")
        return self._future.cancel()

    def cancelled(self) -> bool:
        self._warn("cancelled")
        return self._future.cancelled()

    def running(self) -> bool:
        self._warn("running")
        return self._future.running()

    def done(self) -> bool:
        self._warn("done")
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._warn("exception")
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        self._warn("add_done_callback")
        concurrent.futures.Future.add_done_callback(self, fn)


def deprecated(message: str) -> Callable[[F], F]:
    """Mark a method deprecated as tinker does: a FutureWarning naming the replacement on
    every call. An async method still returns its coroutine, to be awaited as before."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            warnings.warn(message, FutureWarning, stacklevel=2)
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


class ClientFuture(APIFuture[C]):
    """A future of a client that can also be used, deprecated, as the client.

    Reading an instance attribute of the client (such as `model_id`) through the future
    warns and waits for the client, as in tinker 0.38.
    """

    client_label = "client"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        warnings.warn(
            f"Reading `.{name}` from the future returned by a client-creation method is "
            "deprecated. Call .result() on the future, or await it, to get the client first.",
            FutureWarning, stacklevel=2)
        return getattr(self.result(), name)

    def __repr__(self) -> str:
        future = self.future()
        if not future.done():
            state = "pending"
        elif future.cancelled():
            state = "cancelled"
        elif future.exception() is not None:
            state = f"failed: {future.exception()!r}"
        else:
            state = repr(future.result())
        return f"<{type(self).__name__}: {state}>"


def client_future(client_cls: type, label: str) -> type[ClientFuture]:
    """The future class of `client_cls`: every public method of the client is forwarded
    to the finished client with a FutureWarning (async methods await the client first)."""
    message = (f"Using the future as the {label} is deprecated; call .result() on it, or "
               f"await it, to get the {label} first")
    namespace: dict[str, Any] = {"__doc__": f"A future of a `{label}`, usable (deprecated) "
                                            f"as the {label} itself.", "client_label": label,
                                 "__module__": client_cls.__module__}
    for name in dir(client_cls):     # its own methods and those it inherits
        member = inspect.getattr_static(client_cls, name)
        if not name.startswith("_") and inspect.isfunction(member):
            namespace[name] = _forwarder(name, member, message)
    return type(f"{label}Future", (ClientFuture, client_cls), namespace)


def _forwarder(name: str, member: Callable[..., Any], message: str) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(inspect.unwrap(member)):
        async def forward_async(self: ClientFuture, args: tuple, kwargs: dict) -> Any:
            client = await self.result_async()
            return await getattr(client, name)(*args, **kwargs)

        @functools.wraps(member)
        def warn_then_forward(self: ClientFuture, *args: Any, **kwargs: Any) -> Any:
            warnings.warn(message, FutureWarning, stacklevel=2)
            return forward_async(self, args, kwargs)

        return warn_then_forward

    @functools.wraps(member)
    def forward(self: ClientFuture, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(message, FutureWarning, stacklevel=2)
        return getattr(self.result(), name)(*args, **kwargs)

    return forward
