"""A runtime in-process: the real tiny engine and store, the scheduler's worker running,
no front."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from twinkle_server.config.flags import ServerConfig
from twinkle_server.engine.engine import Engine
from twinkle_server.runtime import Runtime
from twinkle_server.store import Store


@pytest.fixture(scope="session")
def engine(tiny_cache) -> Engine:
    return Engine.load("tiny", cache_dir=str(tiny_cache))


def running(rt: Runtime) -> Iterator[Runtime]:
    """`rt` with its workers started; after, its workers stopped, the adapters it made
    removed from the engines the package shares, and it and its store closed."""
    rt.start()
    yield rt
    rt.stop(60)
    for model_id in list(rt.models):
        rt.base_of(model_id).engine.remove_adapter(model_id)
    rt.close()
    rt.store.close()


@pytest.fixture
def runtime(engine, tmp_path):
    yield from running(Runtime(ServerConfig(data_dir=tmp_path), engine, Store(tmp_path)))
