"""Assembly: engine + scheduler + store behind a grpc.aio server with health and reflection,
and the HTTP front (Tinker REST API, /metrics) as a task on the same event loop."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from twinkle_server.config.flags import ServerConfig
from twinkle_server.config.model_table import ModelConfig
from twinkle_server.config.served import Front, write_served
from twinkle_server.engine import Engine
from twinkle_server.engine.errors import EngineError
from twinkle_server.engine.parallel import Parallel
from twinkle_server.engine.protocol import EngineAPI
from twinkle_server.http import HTTP_OFF, HttpServer, bind
from twinkle_server.ranks.channel import Channel
from twinkle_server.ranks.launch import (
    Member,
    load_engine,
    load_engines,
    members,
    several_ranks_problem,
)
from twinkle_server.ranks.replication import ReplicatedEngine
from twinkle_server.ranks.split import SplitEngine
from twinkle_server.runtime import Runtime
from twinkle_server.service.external import ExternalWeightsServicer
from twinkle_server.service.runs import RunsServicer
from twinkle_server.service.sampling import SamplingServicer
from twinkle_server.service.session import SessionServicer
from twinkle_server.service.training import TrainingServicer
from twinkle_server.service.undecodable import RejectUndecodable
from twinkle_server.store import Store
from twinkle_server.store.lock import DataDirInUse, DataDirLock, keys_settled
from twinkle_wire import MAX_MESSAGE_BYTES
from twinkle_wire._proto.twinkle.v1 import (
    external_pb2,
    external_pb2_grpc,
    runs_pb2,
    runs_pb2_grpc,
    sampling_pb2,
    sampling_pb2_grpc,
    session_pb2,
    session_pb2_grpc,
    training_pb2,
    training_pb2_grpc,
)

log = logging.getLogger("twinkle_server")
T = TypeVar("T")
SERVICES = tuple(
    module.DESCRIPTOR.services_by_name[name]
    for module, name in ((session_pb2, "SessionService"), (training_pb2, "TrainingService"),
                         (sampling_pb2, "SamplingService"), (runs_pb2, "RunsService"),
                         (external_pb2, "ExternalWeightsService")))
"""Descriptors of every Twinkle service this server registers."""
SERVICE_NAMES = tuple(service.full_name for service in SERVICES)
EXPIRY_CHECK_SECONDS = 1.0
DRAIN_SECONDS = 60.0
"""How long a stop lets each model's queued training ops finish (samples end at once)."""
ANSWER_GRACE_SECONDS = 5.0
"""After the drain, how long the HTTP front stays up for clients still polling to read
the outcomes the drain gave their ops (`HttpServer.answered`)."""


class ConfigError(Exception):
    """The configuration cannot work; the message says how to fix it."""


class GroupLost(Exception):
    """A rank of a distributed server died or hung; the server has shut down."""


def host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 literal in brackets (`[::1]:8000`), as gRPC targets and URLs
    write it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def config_problem(config: ServerConfig, world: int = 1) -> str | None:
    """Why `config` cannot serve on `world` ranks (the message says how to fix it), or
    None; checked before anything loads, and on several ranks by rank 0 for all of them."""
    if (problem := config.problem()) is not None:
        return problem
    if bool(config.tls_cert) != bool(config.tls_key):
        return "--tls-cert and --tls-key: give both or neither"
    if world == 1 and config.shard_group_size:
        return (f"--shard-group-size {config.shard_group_size}: hybrid sharding needs several "
                "ranks (--nproc-per-node N); the server runs as one process")
    if world == 1 and config.node_rank:
        return (f"--node-rank {config.node_rank}: a node's rank needs several nodes "
                "(--nnodes N --rdzv-endpoint HOST:PORT); the server runs as one process")
    try:
        problem = several_ranks_problem(config, world)
        split = [m.name for m in config.model_configs() if m.sampler_ranks]
    except EngineError as exc:   # the models file
        return str(exc)
    if config.adapter_host_memory_gib > 0 and split:
        return (f"--adapter-host-memory-gib: adapters paged out to disk cannot be published "
                f"to sampler ranks, which {split} have (sampler_ranks); serve them without "
                "it (paged-out adapters then stay in host memory)")
    if problem is not None:
        return problem
    if (problem := _host_problem(config)) is not None:
        return problem
    if is_loopback(config.host):
        return None
    store = Store(config.data_dir)
    try:
        if not store.has_keys():
            return (f"--host {config.host}: no API keys exist, so the server would be open to "
                    "anyone; it binds only to a loopback address (127.0.0.1) without keys. "
                    "Create one with 'twinkle-server keys create --tenant NAME' first.")
    finally:
        store.close()
    return None


def _host_problem(config: ServerConfig) -> str | None:
    """What of this machine the configuration cannot use: the data dir, the TLS files,
    the ports (a port taken after this check still fails at bind, `cli`)."""
    data_dir = config.data_dir.absolute()
    made = next(p for p in (data_dir, *data_dir.parents) if p.exists())
    if not made.is_dir():
        return f"--data-dir {config.data_dir}: {made} is not a directory"
    if not os.access(made, os.W_OK | os.X_OK):
        return f"--data-dir {config.data_dir}: {made} is not writable"
    if config.tls_cert and config.tls_key:
        where = f"--tls-cert {config.tls_cert} --tls-key {config.tls_key}"
        for path in (config.tls_cert, config.tls_key):
            try:
                path.read_bytes()
            except OSError as exc:
                return f"{where}: cannot read {path}: {exc.strerror or exc}"
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(
                config.tls_cert, config.tls_key, password=lambda: b"")
        except ssl.SSLError as exc:
            return (f"{where}: not a PEM certificate and its key (an unencrypted PEM "
                    f"private key that matches it): {exc.reason or exc}")
    ports = [("--port", config.port)]
    if config.http_port != HTTP_OFF:
        ports.append(("--http-port", config.http_port))
    for name, port in ports:
        try:
            bind(config.host, port).close()
        except OSError as exc:
            where = f"{name} {port}" if port else f"--host {config.host}"
            return (f"{where}: cannot listen on {host_port(config.host, port)}: "
                    f"{exc.strerror or exc}")
    return None


async def _load_on_own_thread(load: Callable[..., T], *args: Any) -> T:
    """`load(*args)` (the engines) on a thread that ends once it has loaded.

    On CPU each thread that runs torch's parallel ops keeps its own OpenMP team (libgomp)
    while it lives. A loading thread left idle in a pool, beside the compute thread's
    team, makes more OpenMP threads than cores, and libgomp then stops spin-waiting
    between parallel regions: a decode of 8 x 8 x 64 tokens ran 1.37x slower on 2 cores,
    side by side in one process (BENCHMARKS.md, Sampling). So the compute threads are the
    only threads whose teams outlive the load."""
    with ThreadPoolExecutor(1, thread_name_prefix="twinkle-load") as loader:
        return await asyncio.wrap_future(loader.submit(load, *args))


def _load_held(config: ServerConfig, parallel: Parallel, channel: Channel
               ) -> list[tuple[Member, Engine]]:
    """Rank 0's shard of each served model (of its trainer ranks, for a split one)."""
    held, _ = members(config, parallel, channel)
    return [(m, load_engine(config, m.model, m.parallel)) for m in held]


def _rank_zero_engine(config: ServerConfig, member: Member, local: Engine,
                      on_lost: Callable[[str], None]) -> EngineAPI:
    """What rank 0 drives a model through: its ranks' replicated engine, and for a split
    model the sampler ranks beside it (`twinkle_server.ranks.split`)."""
    engine = ReplicatedEngine(local, member.channel, config.collective_timeout, on_lost)
    if not member.links:
        return engine
    return SplitEngine(engine, member.links, config.collective_timeout)


def own_data_dir(config: ServerConfig) -> DataDirLock:
    """The data dir's lock (`store.lock`), or ConfigError naming the server holding it."""
    try:
        return DataDirLock.take(config.data_dir)
    except DataDirInUse as exc:
        raise ConfigError(str(exc)) from None


async def serve(config: ServerConfig, ready: asyncio.Event | None = None,
                parallel: Parallel | None = None, channel: Channel | None = None,
                lock: DataDirLock | None = None) -> None:
    """Run the server until SIGINT/SIGTERM, then drain and flush the store.

    The data dir is the server's alone from before any cleanup to its exit: `lock`, the
    one rank 0 of several took before they agreed to start, or one taken here.
    With `parallel` (rank 0 of several, `twinkle_server.ranks.launch`) the engine is sharded
    and every call replayed on the other ranks through `channel`; when a rank is lost
    the server drains (ops fail UNAVAILABLE), stops, and raises GroupLost."""
    lock = lock or own_data_dir(config)
    try:
        await _serve_locked(config, ready, parallel, channel, lock)
    finally:
        lock.release()


async def _serve_locked(config: ServerConfig, ready: asyncio.Event | None,
                        parallel: Parallel | None, channel: Channel | None,
                        lock: DataDirLock) -> None:
    problem = config_problem(config, parallel.world if parallel is not None else 1)
    if problem is not None:
        raise ConfigError(problem)
    store = Store(config.data_dir)
    # `keys create` refuses while an open server holds the data dir: such a server
    # decided it is open here, once, and would stay open beside the new key.
    with keys_settled(config.data_dir):
        lock.record(open_mode=not store.has_keys())
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    lost: list[str] = []

    def on_lost(message: str) -> None:  # from the worker thread
        lost.append(message)
        loop.call_soon_threadsafe(stop.set)

    engines: list[tuple[ModelConfig, EngineAPI]]
    if parallel is not None and channel is not None:
        held = await _load_on_own_thread(_load_held, config, parallel, channel)
        engines = [(member.model, _rank_zero_engine(config, member, local, on_lost))
                   for member, local in held]
    else:
        engines = await _load_on_own_thread(load_engines, config)
    try:
        await _serve_engines(config, engines, store, stop, ready, parallel)
    finally:
        for _, engine in engines:
            if isinstance(engine, (ReplicatedEngine, SplitEngine)):
                await asyncio.to_thread(engine.close)
    if lost:
        raise GroupLost(lost[0])
    log.info("stopped")


async def _serve_engines(config: ServerConfig, engines: list[tuple[ModelConfig, EngineAPI]],
                         store: Store, stop: asyncio.Event, ready: asyncio.Event | None,
                         parallel: Parallel | None) -> None:
    """The fronts, schedulers and sweeps over the loaded engines, until `stop`; then
    drain."""
    loop = asyncio.get_running_loop()
    rt = Runtime(config, engines, store)
    # gRPC sets SO_REUSEPORT by default: a second server on a live one's --port would
    # start, and the kernel would split new connections between the two.
    server = grpc.aio.server(interceptors=[RejectUndecodable()], options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.so_reuseport", 0)])
    session_pb2_grpc.add_SessionServiceServicer_to_server(SessionServicer(rt), server)
    training_pb2_grpc.add_TrainingServiceServicer_to_server(TrainingServicer(rt), server)
    sampling_pb2_grpc.add_SamplingServiceServicer_to_server(SamplingServicer(rt), server)
    runs_pb2_grpc.add_RunsServiceServicer_to_server(RunsServicer(rt), server)
    external_pb2_grpc.add_ExternalWeightsServiceServicer_to_server(
        ExternalWeightsServicer(rt), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = host_port(config.host, config.port)
    try:
        if config.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())])
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:   # grpc's "Failed to bind to address"
        rt.close()
        raise ConfigError(f"--port {config.port}: cannot listen on {address}; is another "
                          "server using it? Pick another port (0 picks a free one)") from None
    http = None
    if config.http_port != HTTP_OFF:
        try:
            sock = bind(config.host, config.http_port)
        except OSError as exc:
            await server.stop(None)
            rt.close()
            raise ConfigError(
                f"--http-port {config.http_port}: cannot listen on "
                f"{host_port(config.host, config.http_port)}: {exc.strerror or exc}; is "
                "another server using it? Pick another port (0 picks a free one)") from None
        http = HttpServer(rt, config, sock)
    rt.start()
    await server.start()
    for name in ("", *SERVICE_NAMES):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    if http is not None:
        rt.observe_op = http.metrics.observe
        http.start()
        rt.external.http = Front(config.host, http.port, https=bool(config.tls_cert))
        print(f"http listening on {host_port(config.host, http.port)}", flush=True)
    write_served(config.data_dir, [(s.model, s.engine.base.model_dir) for s in rt.bases],
                 rt.external.http)
    mode = "open (no API keys, loopback only)" if rt.open_mode else "API keys required"
    ranks = f", {parallel.world} ranks" if parallel is not None else ""
    for served in rt.bases:
        log.info("serving %s (role %s) on %s%s, scheduling %s, %s", served.name,
                 served.model.role, served.engine.base.device, ranks, config.scheduling, mode)
    print(f"listening on {host_port(config.host, port)}", flush=True)
    if ready is not None:
        ready.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def expire() -> None:
        while not stop.is_set():
            await asyncio.sleep(EXPIRY_CHECK_SECONDS)
            await rt.expire()

    expiry = asyncio.create_task(expire())
    await stop.wait()
    log.info("draining: finishing in-flight ops, ending samples, refusing new ops")
    rt.draining = True
    drained_from = time.monotonic()
    await health_servicer.enter_graceful_shutdown()
    expiry.cancel()
    await asyncio.to_thread(rt.stop, DRAIN_SECONDS)
    if http is not None:
        await http.answered(drained_from, ANSWER_GRACE_SECONDS)
        await http.stop()
    await server.stop(grace=5.0)
    rt.close()
    store.close()

