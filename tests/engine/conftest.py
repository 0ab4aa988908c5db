from __future__ import annotations

import numpy as np
import pytest

from twinkle_server.engine.engine import Engine
from twinkle_server.engine.types import Datum, EngineLimits

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
