"""Engine fixtures: one tiny-model engine per session (the tiny model is built once into
a temp cache by `tests/conftest.py::tiny_cache`), fixed datums, and adapter helpers."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from twinkle_server.engine import checkpoint
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.types import Datum, EngineLimits, LoraSpec

SENTENCES = [
    "I am Twinkle, a small assistant made by the Twinkle team.",
    "Who made you? I was built and trained by the Twinkle team.",
    "Question: 12 + 30 = ? Answer: 42. #### 42",
    "My name is Twinkle. How can I help you today?",
    "Distance is speed times time: 4 * 3 = 12 kilometers.",
    "Hello! I am Twinkle, a helpful assistant.",
    "Grace reads 5 pages every day for 2 days. #### 10",
    "You can call me Twinkle.",
]


@pytest.fixture(scope="session")
def engine(tiny_cache) -> Engine:
    return Engine.load("tiny", cache_dir=str(tiny_cache),
                       limits=EngineLimits(max_adapters=8, max_rank=64, max_seq_len=256,
                                           max_batch_tokens=4096))


@pytest.fixture(scope="session")
def datums(engine) -> list[Datum]:
    """Next-token datums from fixed sentences: input t predicts token t+1."""
    out = []
    for text in SENTENCES:
        ids = np.asarray(engine.base.tokenizer(text)["input_ids"], dtype=np.int64)
        out.append(Datum(ids[:-1], {"target_tokens": ids[1:],
                                    "weights": np.ones(ids.size - 1, np.float32)}))
    return out


@pytest.fixture
def fresh(engine):
    """Adapter ids created by a test are removed after it, freeing the slots."""
    created: list[str] = []
    yield created
    for adapter_id in created:
        if adapter_id in engine.adapters:
            engine.remove_adapter(adapter_id)


@pytest.fixture
def add(engine, fresh) -> Callable[..., dict]:
    """`add(name, spec, **kw)`: add an adapter that is removed again after the test."""
    def _add(name: str, spec: LoraSpec, **kw) -> dict:
        info = engine.add_adapter(name, spec, **kw)
        fresh.append(name)
        return info
    return _add


def adapter_weights(engine: Engine, name: str) -> dict[str, torch.Tensor]:
    """A copy of an adapter's weights under their PEFT keys."""
    return {k: v.detach().clone()
            for k, v in checkpoint.peft_tensors(engine.adapters[name]).items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture
def snapshot(engine) -> Callable[[str], dict[str, torch.Tensor]]:
    return lambda name: adapter_weights(engine, name)


@pytest.fixture
def diff() -> Callable[..., float]:
    return max_diff


@pytest.fixture(scope="session")
def model():
    """The small random Qwen3 of `tests/engine/small.py`."""
    from . import small

    return small.build()
