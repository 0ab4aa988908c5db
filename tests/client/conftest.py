"""Client fixtures: one real server per test module on the tiny model, clients that close
(so their adapters are unloaded), and toy features with known label counts."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle_client import init_twinkle_client
from twinkle_client.client import TwinkleClient
from twinkle_server.process import ServerProcess, start_server

MAX_ADAPTERS_PER_TENANT = 32
"""Raised from the default 8: a module creates a dozen adapters on one server."""


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache) -> ServerProcess:
    proc = start_server(tmp_path_factory.mktemp("client-server"),
                        "--max-adapters-per-tenant", str(MAX_ADAPTERS_PER_TENANT))
    yield proc
    proc.stop()


@pytest.fixture
def client(server) -> TwinkleClient:
    with init_twinkle_client(base_url=f"http://{server.address}", api_key="EMPTY_TOKEN") as c:
        yield c


def toy_features(n: int, length: int = 12, prompt: int = 4, seed: int = 0,
                 vocab: int = 200) -> list[dict[str, np.ndarray]]:
    """`n` features of `length` tokens whose first `prompt` positions carry no loss, so
    every feature has the same number of label tokens (`length - prompt`)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(3, vocab, length + 1)
        labels = tokens[1:].copy()
        labels[:prompt] = -100
        out.append({"input_ids": tokens[:-1], "labels": labels})
    return out
