"""Sampling on the runtime in-process: without a session (the OpenAI route's verb), and a
session's samples side by side."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

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


def test_a_cancelled_sample_beside_a_like_one_of_its_session_ends_cleanly(runtime):
    """A client session's ops in flight are tracked by identity: two samples of one
    sampling session with one prompt compare their numpy prompts under `==`, which
    cannot, and the later one's end (here its cancel) once raised ValueError there."""
    async def scenario():
        session = await runtime.runs.create_session("alice", {})
        sampler = await runtime.sampling.create_session("alice", session, base_model="tiny")
        target = runtime.sampling.target("alice", None, sampler)
        first, second = (asyncio.ensure_future(runtime.sampling.sample(
            target, np.arange(3, 9), 1, SamplingParams(max_tokens=64, seed=seed,
                                                       ignore_eos=True)))
            for seed in (1, 2))
        await asyncio.sleep(0.05)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        return await first

    assert len(asyncio.run(scenario()).sequences) == 1
