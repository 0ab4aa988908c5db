"""Test helpers: real server processes and the raw transport, plus toy data."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from twinkle_client.transport import Transport as Client  # noqa: F401
from twinkle_server.process import ServerProcess, start_server  # noqa: F401


def twinkle_server(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twinkle_server.cli", *args],
                          capture_output=True, text=True, timeout=120)


def toy_datums(n: int = 4, length: int = 12, vocab: int = 200, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, length + 1)
        out.append((ids[:-1], {"target_tokens": ids[1:],
                               "weights": np.ones(length, np.float32)}))
    return out
