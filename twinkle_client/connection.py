"""One connection to a Twinkle server, shared by both clients.

It owns what every call needs: the gRPC channel (plaintext or TLS, from the base URL), the
`authorization: Bearer <key>` metadata, a session kept alive by a background heartbeat,
the per-model `seq_id` counters that order a model's ops, the thread pool that runs calls
so they can be submitted before they are awaited, retries of idempotent calls while the
server is unreachable, and the mapping of a failed call to an exception (`errors`).

It carries messages and builds none but its own session's: what each call sends and what
its reply means is `twinkle_client.api`, the typed layer both clients call.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc

from twinkle_client import errors
from twinkle_client.futures import CallFuture, Future, running_call
from twinkle_wire._proto.twinkle.v1 import (
    external_pb2_grpc,
    runs_pb2_grpc,
    sampling_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
    training_pb2_grpc,
)

log = logging.getLogger("twinkle_client")

CALL_TIMEOUT_S = 600.0
"""Deadline of one unordered call (sessions, listings, downloads). Ordered ops (those with
an OpHeader) have none: they wait behind the model's earlier ops for as long as those take,
and the server runs them even after a client stops waiting, so a deadline would only
report as failed an op that is still applied."""
RETRY_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 4.0)
"""Back-off before each retry of an idempotent call answered UNAVAILABLE (~8 s in all)."""
MAX_INFLIGHT_CALLS = 64
"""Threads that carry calls; more submitted calls wait in order for a free one."""

T = TypeVar("T")


def parse_base_url(base_url: str) -> tuple[str, bool]:
    """`http://host:port` -> plaintext, `https://host:port` -> TLS, bare `host:port` ->
    plaintext. Returns (gRPC target, use TLS)."""
    if not base_url or not base_url.strip():
        raise ValueError("base_url: empty; pass e.g. 'http://127.0.0.1:8000'")
    text = base_url.strip()
    if "://" not in text:
        return text.rstrip("/"), False
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https", "grpc", "grpcs"):
        raise ValueError(f"base_url: scheme {parts.scheme!r} of {base_url!r} is not one of "
                         "http, https, grpc, grpcs")
    secure = parts.scheme in ("https", "grpcs")
    if not parts.hostname:
        raise ValueError(f"base_url: {base_url!r} has no host")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = parts.port or (443 if secure else 80)
    return f"{host}:{port}", secure


def setting(value: str | None, *env_names: str) -> str | None:
    """`value` if given, else the first of `env_names` that is set and not empty."""
    if value:
        return value
    return next((os.environ[name] for name in env_names if os.environ.get(name)), None)


BASE_URL_ENV = ("TWINKLE_BASE_URL", "TINKER_BASE_URL")
"""Where every client entry point looks for the server when given no base_url, in order."""
API_KEY_ENV = ("TWINKLE_API_KEY", "TINKER_API_KEY")
"""Where every client entry point looks for the API key when given none, in order."""


def env_endpoint(base_url: str | None = None, api_key: str | None = None
                 ) -> tuple[str | None, str | None]:
    """The server URL and API key a client uses: each argument if given, else the first
    of `BASE_URL_ENV` / `API_KEY_ENV` that is set and not empty, else None.

    Example:
        url, key = env_endpoint()   # with TWINKLE_BASE_URL=http://127.0.0.1:8000 exported
    """
    return setting(base_url, *BASE_URL_ENV), setting(api_key, *API_KEY_ENV)


@dataclass(frozen=True)
class Op:
    """A reserved place in a model's op order: the model, its `seq_id`, and a fresh
    request id. Every op reserved must reach the server (`api.release` spends one that
    carries no op), or the model's later ops wait for it."""

    model_id: str
    seq_id: int
    request_id: str


class Connection:
    """A channel, a session and the ordered-op machinery for one server and one API key.

    Args:
        base_url: `http://host:port`, `https://host:port` or `host:port`.
        api_key: sent as `authorization: Bearer <key>`; None for an open (keyless) server.
        client_name: reported to the server when the session opens.
        error_factory: builds the exception for a failed call from its category; each
            client passes its own exception family.
        root_certificates: PEM bytes of the CA for a TLS server with a private CA (else
            the file named by `TWINKLE_TLS_CA_FILE`, else the system roots).
        open_session: open a session with a heartbeat thread (models created under it are
            unloaded by the server when the heartbeat stops).
    """

    def __init__(self, base_url: str, api_key: str | None = None, *, client_name: str,
                 error_factory: errors.ErrorFactory = errors.native_error,
                 root_certificates: bytes | None = None, open_session: bool = True,
                 tags: Mapping[str, str] | None = None) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.target, secure = parse_base_url(base_url)
        self.error_factory = error_factory
        if secure:
            ca_file = os.environ.get("TWINKLE_TLS_CA_FILE")
            if root_certificates is None and ca_file:
                root_certificates = Path(ca_file).read_bytes()
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.secure_channel(self.target, credentials)
        else:
            self.channel = grpc.insecure_channel(self.target)
        # Kept, with the key, so that a copy of a client in another process can reconnect.
        self.root_certificates = root_certificates
        self.metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key else ())
        self.session = session_pb2_grpc.SessionServiceStub(self.channel)
        self.training = training_pb2_grpc.TrainingServiceStub(self.channel)
        self.sampling = sampling_pb2_grpc.SamplingServiceStub(self.channel)
        self.runs = runs_pb2_grpc.RunsServiceStub(self.channel)
        self.external = external_pb2_grpc.ExternalWeightsServiceStub(self.channel)
        self._pool = ThreadPoolExecutor(MAX_INFLIGHT_CALLS, thread_name_prefix="twinkle-call")
        self._seq: dict[str, int] = {}
        self._seq_lock = threading.Lock()
        self._closed = threading.Event()
        self._submit_lock = threading.Lock()
        self.session_id: str | None = None
        self._heartbeat: threading.Thread | None = None
        # Server facts the typed calls keep for this connection's life (`api.capabilities`).
        self.cache: dict[str, Any] = {}
        if open_session:
            self._open_session(client_name, tags or {})

    # ------------------------------------------------------------------ calls

    def call(self, method: Any, request: Any, *, timeout: float | None = None,
             retry: bool = True) -> Any:
        """A unary call with this connection's key and deadline.

        Idempotent calls (`retry=True`: reads, and every op carrying a seq_id, which the
        server answers from its stored result when repeated) are retried while the server
        is UNAVAILABLE. Failures raise the client's exception for the status.
        """
        name = _method_name(method)
        ordered = hasattr(request, "op") and request.HasField("op")
        deadline = timeout or (None if ordered else CALL_TIMEOUT_S)
        for attempt in range(len(RETRY_DELAYS_S) + 1):
            try:
                return self._unary(method, request, deadline)
            except grpc.RpcError as exc:
                if not self._retryable(exc, retry, attempt):
                    raise errors.from_rpc_error(exc, name, self.error_factory) from None
            time.sleep(RETRY_DELAYS_S[attempt])
        raise AssertionError("unreachable")

    def _unary(self, method: Any, request: Any, deadline: float | None) -> Any:
        """One attempt of a unary call. Made by an interruptible call on the pool, it is
        cancelled with that call's future (the server stops it), raising CancelledError."""
        call = running_call()
        if call is None or not call.interruptible:
            return method(request, metadata=self.metadata, timeout=deadline)
        rpc = method.future(request, metadata=self.metadata, timeout=deadline)
        if not call.attach(rpc.cancel):
            rpc.cancel()
        try:
            return rpc.result()
        except grpc.FutureCancelledError:
            raise CancelledError(f"{_method_name(method)}: cancelled by its future") from None

    def _retryable(self, exc: grpc.RpcError, retry: bool, attempt: int) -> bool:
        return (retry and attempt < len(RETRY_DELAYS_S) and not self._closed.is_set()
                and exc.code() == grpc.StatusCode.UNAVAILABLE
                and "shutting down" not in (exc.details() or ""))

    def stream(self, method: Any, request: Any, *, timeout: float | None = None
               ) -> Iterator[Any]:
        """A server-streaming call's messages; failures raise like `call`."""
        try:
            yield from method(request, metadata=self.metadata, timeout=timeout or CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc, _method_name(method), self.error_factory) from None

    def call_stream(self, method: Any, messages: Sequence[Any]) -> list[Any]:
        """The replies of a client-and-server-streaming ordered op, `messages` sent as one
        stream. The whole stream is resent (same seq_id) while the server is unreachable;
        there is no deadline, as for every ordered op. Failures raise like `call`."""
        for attempt in range(len(RETRY_DELAYS_S) + 1):
            try:
                return list(method(iter(messages), metadata=self.metadata))
            except grpc.RpcError as exc:
                if not self._retryable(exc, True, attempt):
                    raise errors.from_rpc_error(exc, _method_name(method),
                                                self.error_factory) from None
            time.sleep(RETRY_DELAYS_S[attempt])
        raise AssertionError("unreachable")

    def submit(self, fn: Callable[..., T], *args: Any, future_class: type[Future] = Future,
               on_cancel: Callable[[], Any] | None = None, interruptible: bool = False,
               **kwargs: Any) -> Future[T]:
        """Run `fn(*args, **kwargs)` on the call pool; returns its future at once.

        A future cancelled before `fn` starts runs `on_cancel` on the pool instead: a call
        that reserved seq_ids passes their release, so the model's later ops do not wait.
        Once started, `fn` can be cancelled only if `interruptible` (a sample, which the
        server can stop): its gRPC calls are cancelled with the future.
        """
        with self._submit_lock:
            if self._closed.is_set():
                raise self.error_factory("failed_precondition",
                                         f"connection to {self.base_url} is closed", "")
            future = CallFuture(interruptible)
            self._pool.submit(future.run, fn, args, kwargs, on_cancel)
            return future_class(future)

    # ------------------------------------------------------------------ ordered ops

    def register_model(self, model_id: str, next_seq_id: int) -> None:
        """Start numbering `model_id`'s ops where the server expects them."""
        with self._seq_lock:
            self._seq[model_id] = next_seq_id

    def reserve(self, model_id: str) -> Op:
        """The next place in `model_id`'s op order: seq_ids in call order."""
        with self._seq_lock:
            if model_id not in self._seq:
                raise self.error_factory("failed_precondition",
                                         f"model_id: {model_id!r} was not created or loaded "
                                         "through this connection", "")
            seq = self._seq[model_id]
            self._seq[model_id] = seq + 1
        return Op(model_id, seq, uuid.uuid4().hex)

    # ------------------------------------------------------------------ session

    def _open_session(self, client_name: str, tags: Mapping[str, str]) -> None:
        reply = self.call(self.session.CreateSession, session_pb2.CreateSessionRequest(
            client_name=client_name, tags=dict(tags)), retry=False)
        self.session_id = reply.session_id
        interval = max(0.5, reply.heartbeat_interval_s)
        self._heartbeat = threading.Thread(target=self._beat, args=(interval,),
                                           name="twinkle-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self, interval_s: float) -> None:
        request = session_pb2.HeartbeatRequest(session_id=self.session_id)
        while not self._closed.wait(interval_s):
            try:
                self.session.Heartbeat(request, metadata=self.metadata, timeout=interval_s)
            except grpc.RpcError as exc:
                log.warning("heartbeat of session %s failed: %s", self.session_id,
                            exc.details() or exc.code())

    def close(self) -> None:
        """Stop the heartbeat, close the session (the server unloads its models; saved
        checkpoints stay), wait for submitted calls, and close the channel."""
        with self._submit_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._pool.shutdown(wait=True)
        if self.session_id:
            try:
                self.session.CloseSession(session_pb2.CloseSessionRequest(
                    session_id=self.session_id), metadata=self.metadata, timeout=10)
            except grpc.RpcError as exc:
                log.warning("closing session %s: %s", self.session_id, exc.details())
        self.channel.close()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _method_name(method: Any) -> str:
    raw = getattr(method, "_method", b"")
    return (raw.decode() if isinstance(raw, bytes) else str(raw)).rsplit("/", 1)[-1]


_default: Connection | None = None
_default_lock = threading.Lock()


def set_default_connection(connection: Connection | None) -> None:
    """Make `connection` the one that objects created without a client use
    (`MultiLoraTransformersModel`, templates fetching a tokenizer); None: no default.
    `init_twinkle_client` and `init_tinker_client(base_url=...)` set it."""
    global _default
    with _default_lock:
        _default = connection


def get_default_connection() -> Connection | None:
    """The connection `set_default_connection` made the default, or None."""
    return _default
