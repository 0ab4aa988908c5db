"""A runtime in-process: the real tiny engine and store, the scheduler's worker running,
no front."""

from __future__ import annotations

import pytest

from twinkle_server.config import ServerConfig
from twinkle_server.engine.engine import Engine
from twinkle_server.runtime import Runtime
from twinkle_server.store import Store


@pytest.fixture(scope="package")
def engine(tiny_cache) -> Engine:
    return Engine.load("tiny", cache_dir=str(tiny_cache))


@pytest.fixture
def runtime(engine, tmp_path):
    rt = Runtime(ServerConfig(data_dir=tmp_path), engine, Store(tmp_path))
    rt.start()
    yield rt
    rt.stop(60)
    for model_id in list(rt.models):
        engine.remove_adapter(model_id)
    rt.close()
    rt.store.close()
