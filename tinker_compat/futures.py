"""Tinker's futures over Twinkle's: every call returns one at once.

`APIFuture` is both a `twinkle_client.futures.Future` (result, result_async, await, done,
exception, future) and a `tinker.APIFuture`, so `isinstance(f, tinker.APIFuture)` and
annotations in user code hold. `ClientFuture` is what the `create_*` methods return, as in
tinker 0.38: a future of a client that may also be used, deprecated with a FutureWarning,
as the client itself (`client_future(TrainingClient)` builds the forwarding class).
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import warnings
from collections.abc import Callable
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
