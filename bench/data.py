"""Random training data for the engine benchmarks: datums of random token ids, each
target the next id, every token weighted 1 (no download, the same for a seed)."""

from __future__ import annotations

import numpy as np

from twinkle_server.engine.types import Datum


def random_datums(n: int, length: int, vocab: int, seed: int = 0) -> list[Datum]:
    """`n` datums of `length` tokens with ids in `[3, vocab)`."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, length + 1)
        out.append(Datum(ids[:-1], {"target_tokens": ids[1:],
                                    "weights": np.ones(length, np.float32)}))
    return out


def mixed_datums(n: int, low: int, high: int, vocab: int, seed: int) -> list[Datum]:
    """`n` datums whose lengths are drawn uniformly from `[low, high]`."""
    lengths = np.random.default_rng(seed).integers(low, high + 1, n)
    return [random_datums(1, int(length), vocab, seed=seed * 1000 + i)[0]
            for i, length in enumerate(lengths)]
