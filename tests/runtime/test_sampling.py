"""Sampling without a session (the OpenAI route's verb) on the runtime in-process."""

from __future__ import annotations

import asyncio

import numpy as np

from twinkle_server.engine.types import SamplingParams
from twinkle_server.runtime.sampling import Source


def test_a_sample_without_a_session_adds_no_queue_to_the_scheduler(runtime):
    served = runtime.bases.default
    before = served.scheduler.stats()["queues"]
    seen: list[int] = []

    async def sample_and_watch():
        work = asyncio.ensure_future(runtime.sampling.sample_from(
            Source(served), np.arange(3, 9), 2, SamplingParams(max_tokens=24, seed=1)))
        while not work.done():
            seen.append(served.scheduler.stats()["queues"])
            await asyncio.sleep(0.001)
        return work.result()

    result = asyncio.run(sample_and_watch())
    assert len(result.sequences) == 2
    assert set(seen) == {before} and served.scheduler.stats()["queues"] == before
