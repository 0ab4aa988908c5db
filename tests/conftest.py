"""Shared fixtures: the tiny model is built once per test session into a temp cache."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator

import pytest
import torch

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
         else os.cpu_count() or 1)
"""The cores this process may run on (a container's cpuset, not the host's count)."""
THREADS = max(1, min(2, CORES // WORKERS))
"""Compute threads of each test process and of every server or rank it starts (they read
OMP_NUM_THREADS): the workers share the cores. With torch's default (a thread per core)
in every process, two workers and their servers ran twice as many spinning threads as
cores, and burnt near half the suite's CPU time waiting (tests/http: 461 s of CPU and
265 s against 259 s and 165 s with one thread each, 2-core AMD EPYC)."""
os.environ["OMP_NUM_THREADS"] = str(THREADS)
torch.set_num_threads(THREADS)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """A cache dir holding the tiny model; TWINKLE_CACHE_DIR points at it for subprocesses."""
    from twinkle_server.engine.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("twinkle-cache")
    build_tiny_model(root)
    os.environ["TWINKLE_CACHE_DIR"] = str(root)
    return root


@pytest.fixture(scope="session", autouse=True)
def sdk_heartbeats_stop_with_their_server() -> Iterator[None]:
    """A stock-SDK client beats its session's heartbeat until it is closed. One a test left
    open after its server stopped failed its beats and warned ("Session heartbeat failed
    ... Connection error") minutes later, in the middle of other tests' output (7 to 32
    such lines a `make test`). A server a test stops now takes with it the heartbeats of
    the SDK's connections to it (its `InternalClientHolder`s, which a training client
    keeps after its `ServiceClient` is gone): only those local tasks end, nothing is sent
    to the stopped server."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from tinker.lib.internal_client_holder import InternalClientHolder

    from twinkle_server.process import ServerProcess

    holders: weakref.WeakSet = weakref.WeakSet()
    create, stop = InternalClientHolder.__init__, ServerProcess.stop

    def created(holder, *args, **kwargs) -> None:
        holders.add(holder)
        create(holder, *args, **kwargs)

    def stopped(server: ServerProcess, *args, **kwargs) -> int:
        code = stop(server, *args, **kwargs)
        for holder in list(holders):
            if server.http_address and f"//{server.http_address}" in getattr(
                    holder, "_base_url", ""):
                holder.close()
        return code

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InternalClientHolder, "__init__", created)
        patch.setattr(ServerProcess, "stop", stopped)
        yield
