"""The HTTP front: the Tinker REST API, so the stock `tinker` SDK works unmodified, plus
`/metrics` (Prometheus) and `/api/v1/healthz` on the same port, and the signed
download URLs of external weights (`external`).

A thin adapter, like the gRPC front: routes (`app`, `training`, `sampling`, `rest`,
`admin`; the OpenAI-compatible ones in `oai`, Anthropic's Messages in `anthropic`) read the SDK's bodies
(`convert`), call the same runtime verbs with the tenant from the same
`Runtime.authenticate`, and answer in the SDK's shapes; ops become futures (`futures`)
that `retrieve_future` resolves; failures map to statuses in one place (`errors`); the
SDK's routes this server does not provide say so by name (`unserved`).

Stack: Starlette on uvicorn. `uvicorn.Server.serve()` is a coroutine, so the HTTP server
runs as one more task on the loop that runs `grpc.aio` and the runtime: no second
thread or process, and both fronts share the scheduler, store and futures without
locks. Starlette is the small, well-kept ASGI toolkit FastAPI is built on; FastAPI's
extra (pydantic request models, OpenAPI) buys nothing here, because the SDK's own types
are the contract, `forward_backward` arrives as protobuf, and our messages name the field
and the limit the way the gRPC front's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from twinkle_server.config.flags import ServerConfig
from twinkle_server.http import unserved
from twinkle_server.http.admin import AdminRoutes
from twinkle_server.http.anthropic import AnthropicRoutes
from twinkle_server.http.app import Front
from twinkle_server.http.external import ExternalRoutes
from twinkle_server.http.metrics import Metrics
from twinkle_server.http.oai import OpenAIRoutes
from twinkle_server.http.rest import Rest
from twinkle_server.http.sampling import SamplingRoutes
from twinkle_server.http.training import TrainingRoutes
from twinkle_server.runtime import Runtime

log = logging.getLogger("twinkle_server")
HTTP_OFF = -1
"""`--http-port -1` turns the HTTP front off; 0 picks a free port."""


def build_app(rt: Runtime) -> tuple[Starlette, Front, Metrics]:
    front = Front(rt)
    metrics = Metrics(rt, front.futures.pending)
    routes = [*front.routes(), *TrainingRoutes(front).routes(),
              *SamplingRoutes(front).routes(), *Rest(front).routes(), *ExternalRoutes(front).routes(),
              *AdminRoutes(front).routes(), *OpenAIRoutes(front).routes(),
              *AnthropicRoutes(front).routes(),
              *unserved.routes(front), Route("/metrics", metrics.endpoint, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={404: unserved.not_found(front)})
    return app, front, metrics


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `server.serve` owns SIGINT/SIGTERM and
    stops this server as part of its drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        pass


def bind(host: str, port: int) -> socket.socket:
    """The listening socket. Made with `IPPROTO_TCP` named, not the default 0: asyncio
    turns Nagle off (TCP_NODELAY) only on accepted sockets whose `proto` is IPPROTO_TCP,
    and they inherit it from this one. With Nagle on, a response's body (written after
    its headers) waited for the client's delayed ACK: ~40 ms on many responses, up to
    ~90 ms of each forward_backward + optim_step through the SDK (issue 18)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class HttpServer:
    """The ASGI app served by uvicorn on the running loop."""

    def __init__(self, rt: Runtime, config: ServerConfig, sock: socket.socket) -> None:
        """Serve on `sock`, bound by the caller (`bind`) to `config`'s host and port."""
        self.app, self.front, self.metrics = build_app(rt)
        self.socket = sock
        self.port = self.socket.getsockname()[1]
        ssl = ({"ssl_certfile": str(config.tls_cert), "ssl_keyfile": str(config.tls_key)}
               if config.tls_cert else {})
        self.server = _Server(uvicorn.Config(
            self.app, log_config=None, access_log=False, lifespan="off",
            timeout_keep_alive=75, **ssl))
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.socket]))

    async def answered(self, since: float, grace_s: float) -> None:
        """Wait, at most `grace_s` seconds, until every op that finished at or after
        `since` has had its outcome read by its client (`retrieve_future`): the ops a
        drain finishes or fails reach clients still polling before the front stops."""
        deadline = time.monotonic() + grace_s
        while self.front.futures.unanswered(since) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        self.server.should_exit = True
        self.front.futures.close()
        if self.task is not None:
            await asyncio.wait([self.task], timeout=10)
