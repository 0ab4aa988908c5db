"""One real server on loopback for the package's integration tests, plus toy data."""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from tinker_compat import ServiceClient
from twinkle_server.process import start_server

MAX_BATCH_TOKENS = 8_000_000
"""Raised so the 16 MiB batch test fits in one request (the default is 262,144 tokens)."""


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("tinker-compat-server"),
                        "--max-batch-tokens", str(MAX_BATCH_TOKENS),
                        "--max-adapters-per-tenant", "32", "--max-adapters", "64")
    yield proc
    proc.stop()


@pytest.fixture
def base_url(server) -> str:
    return f"http://{server.address}"


@pytest.fixture
def service_client(base_url):
    client = ServiceClient(base_url=base_url)
    yield client
    client.close()


def sft_data(n: int = 4, length: int = 16, vocab: int = 200, seed: int = 0
             ) -> list[types.Datum]:
    """Random next-token datums, the way Tinker's docs build them: tokens, targets, weights."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(n):
        ids = rng.integers(3, vocab, length + 1)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1].tolist()),
            loss_fn_inputs={"target_tokens": ids[1:], "weights": np.ones(length, np.float32)}))
    return data
