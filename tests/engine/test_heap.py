"""Freed pass memory goes back to the OS (`engine.heap`): results that outlive their pass
(the HTTP futures table keeps each op's for retries) must not pin the freed tensors of
every pass around them in glibc's heap."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle_server.engine import heap
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.types import Datum, EngineLimits, ForwardRequest, LoraSpec, LossSpec

pytestmark = pytest.mark.skipif(heap.free_bytes() is None or heap.resident_bytes() is None,
                                reason="trimming is glibc's (malloc_trim) on Linux")

KEPT = 200
GROWTH_BOUND = 256 * 2**20
"""Without trimming, keeping 200 results of 8 x 32-token passes of the tiny model grew the
process by 350-500 MiB (2-core AMD EPYC, glibc 2.36), though they hold 1 KiB each; with
a 64 MiB slack it stays within the slack plus twice a pass's working set (~40 MiB) of
its last trim."""


def test_results_kept_across_many_passes_do_not_grow_the_process(tiny_cache):
    engine = Engine.load("tiny", cache_dir=str(tiny_cache),
                         limits=EngineLimits(max_adapters=2))
    engine.heap = heap.Trimmer(slack=64 * 2**20)
    engine.add_adapter("a", LoraSpec(rank=4, alpha=8, seed=1))
    rng = np.random.default_rng(0)
    data = []
    for _ in range(8):
        ids = rng.integers(3, 4000, 33)
        data.append(Datum(ids[:-1], {"target_tokens": ids[1:],
                                     "weights": np.ones(32, np.float32)}))
    request = ForwardRequest("a", data, LossSpec("cross_entropy"), True)
    kept = [engine.forward_batch([request]) for _ in range(5)]
    warm = heap.resident_bytes()
    kept += [engine.forward_batch([request]) for _ in range(KEPT)]
    assert heap.resident_bytes() - warm < GROWTH_BOUND
    assert len(kept) == KEPT + 5
