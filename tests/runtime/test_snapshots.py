"""Snapshot sampling sessions (Tinker's ephemeral `save_weights_and_get_sampling_client`)
in-process: the weights are no checkpoint (never listed, never counted), they sample what
the model had, and they live as long as their client session (deleted when it closes, and
at a restart), except those a loop has moved past: superseded by a newer snapshot of the
same model, neither its first nor its newest, and unused for the session timeout."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from twinkle_server.engine.errors import NotFound
from twinkle_server.engine.types import LoraSpec, SamplingParams
from twinkle_server.runtime import OpRef, Runtime
from twinkle_server.store import Store

from ..numerics import assert_alike_until_a_near_tie, topk_greedy_could_draw

PROMPT = np.array([5, 6, 7, 8], np.int64)
GREEDY = SamplingParams(max_tokens=3, temperature=0.0, seed=0)


async def _snapshot(rt: Runtime, tenant: str = "alice") -> tuple[str, str, str]:
    """A session, a model in it and a snapshot sampling session of the model:
    (session id, model id, sampling session id)."""
    session = await rt.runs.create_session(tenant, {})
    info = await rt.training.create_model(tenant, spec=LoraSpec(rank=4, alpha=8, seed=0),
                                          session_id=session)
    model_id = info.entry.model_id
    return session, model_id, await rt.sampling.snapshot(tenant, OpRef(model_id, 0))


def _weights(rt: Runtime, sampling_id: str) -> Path:
    return Path(rt.samplers[sampling_id].weights_path)


def test_a_snapshot_samples_the_models_weights_and_is_no_checkpoint(runtime):
    async def scenario():
        _, model_id, sampler = await _snapshot(runtime)
        folder = _weights(runtime, sampler)
        assert (folder / "adapter_model.safetensors").is_file()
        assert runtime.store.checkpoint_root not in folder.parents
        # Not listed, by run or by tenant, nor in the store the CLI's `runs list` reads.
        assert runtime.runs.list_checkpoints("alice").total == 0
        assert runtime.runs.list_checkpoints("alice", model_id).total == 0
        assert runtime.store.list_checkpoints(None, None) == ([], 0)
        assert runtime.runs.get_run("alice", model_id).last_sampler_checkpoint is None
        # It samples what the model samples (the same weights, greedy, through another
        # adapter slot: the same tokens up to a near tie, tests/numerics.py).
        snap = await runtime.sampling.sample(
            runtime.sampling.target("alice", None, sampler), PROMPT, 1, GREEDY)
        live = await runtime.sampling.sample(
            runtime.sampling.target("alice", OpRef(model_id, 1)), PROMPT, 1, GREEDY,
            topk_sample_logprobs=2)
        assert_alike_until_a_near_tie(live.sequences[0], snap.sequences[0],
                                      topk_greedy_could_draw(live.sequences[0]))
        with pytest.raises(NotFound):
            runtime.sampling.target("bob", None, sampler)

    asyncio.run(scenario())


def test_closing_the_session_ends_its_snapshot_sessions_and_deletes_their_weights(runtime):
    async def scenario():
        session, _, sampler = await _snapshot(runtime)
        _, _, other = await _snapshot(runtime)
        folder = _weights(runtime, sampler)
        await runtime.runs.close_session("alice", session)
        assert not folder.exists()
        with pytest.raises(NotFound, match="no sampling session"):
            runtime.sampling.target("alice", None, sampler)
        assert _weights(runtime, other).is_dir()   # another session's stays

    asyncio.run(scenario())


def test_a_held_reference_outlives_the_timeout_and_superseded_idle_snapshots_go(runtime):
    """DPO's reference (the model's first snapshot) and the latest weights stay however
    long they are idle; the snapshots in between go once idle for the timeout."""
    async def scenario():
        session, model_id, reference = await _snapshot(runtime)
        between = [await runtime.sampling.snapshot("alice", OpRef(model_id, seq))
                   for seq in (1, 2)]
        newest = await runtime.sampling.snapshot("alice", OpRef(model_id, 3))
        other = await runtime.training.create_model(
            "alice", spec=LoraSpec(rank=4, alpha=8, seed=1), session_id=session)
        only = await runtime.sampling.snapshot("alice", OpRef(other.entry.model_id, 0))
        named = await runtime.sampling.create_session("alice", session, model_id=model_id)
        timeout = runtime.config.session_timeout
        folders = [_weights(runtime, s) for s in between]
        await runtime.lifetimes.expire_snapshots(now=time.monotonic() + timeout / 2)
        assert all(f.is_dir() for f in folders)            # not idle long enough yet
        await runtime.lifetimes.expire_snapshots(now=time.monotonic() + 10 * timeout)
        assert not any(f.exists() for f in folders)
        assert not any(s in runtime.samplers for s in between)
        for kept in (reference, newest, only):   # first, newest, another model's only
            assert _weights(runtime, kept).is_dir()
        assert named in runtime.samplers                    # not a snapshot
        sampled = await runtime.sampling.sample(
            runtime.sampling.target("alice", None, reference), PROMPT, 1, GREEDY)
        assert len(sampled.sequences) == 1

    asyncio.run(scenario())


def test_an_rl_loop_of_snapshots_keeps_a_bounded_number_on_disk(runtime):
    async def scenario():
        _, model_id, first = await _snapshot(runtime)
        timeout = runtime.config.session_timeout
        latest = first
        for step in range(1, 12):   # one snapshot a step, each step longer than the timeout
            latest = await runtime.sampling.snapshot("alice", OpRef(model_id, step))
            await runtime.sampling.sample(runtime.sampling.target("alice", None, latest),
                                          PROMPT, 1, GREEDY)
            await runtime.lifetimes.expire_snapshots(now=time.monotonic() + step * (timeout + 1))
            on_disk = sorted(p.name for p in runtime.snapshot_root.iterdir())
            assert on_disk == sorted({first, latest})

    asyncio.run(scenario())


def test_a_snapshot_outside_any_session_goes_when_unused_for_the_timeout(runtime):
    async def scenario():
        info = await runtime.training.create_model("alice", spec=LoraSpec(rank=4, alpha=8))
        sampler = await runtime.sampling.snapshot("alice", OpRef(info.entry.model_id, 0))
        folder = _weights(runtime, sampler)
        await runtime.lifetimes.expire_snapshots(now=time.monotonic() + runtime.config.session_timeout + 1)
        assert sampler not in runtime.samplers and not folder.exists()

    asyncio.run(scenario())


def test_a_restart_deletes_the_snapshots_of_sessions_that_are_gone(engine, runtime):
    asyncio.run(_snapshot(runtime))
    (folder,) = runtime.snapshot_root.iterdir()
    data_dir = runtime.store.data_dir
    # The same data dir again, as a restarted server finds it (the session still open in
    # the store, its sampling sessions gone with the process).
    store = Store(data_dir)
    restarted = Runtime(replace(runtime.config), engine, store)
    try:
        assert not folder.exists() and not restarted.samplers
        assert store.open_sessions("alice") == 1
    finally:
        restarted.close()
        store.close()


def test_a_snapshot_with_a_request_waiting_or_running_is_not_idle(runtime):
    async def scenario():
        _, model_id, _ = await _snapshot(runtime)
        sampler = await runtime.sampling.snapshot("alice", OpRef(model_id, 1))
        await runtime.sampling.snapshot("alice", OpRef(model_id, 2))   # supersedes it
        gate = threading.Event()
        busy = asyncio.ensure_future(runtime.admin("block", lambda: gate.wait(60)))
        request = asyncio.ensure_future(runtime.sampling.sample(
            runtime.sampling.target("alice", None, sampler), PROMPT, 1, GREEDY))
        await asyncio.sleep(0.1)
        far = time.monotonic() + 10 * runtime.config.session_timeout
        await runtime.lifetimes.expire_snapshots(now=far)
        assert sampler in runtime.samplers and runtime.samplers[sampler].in_flight == 1
        gate.set()
        await busy
        assert len((await request).sequences) == 1
        assert runtime.samplers[sampler].in_flight == 0
        await runtime.lifetimes.expire_snapshots(now=far)
        assert sampler not in runtime.samplers

    asyncio.run(scenario())


def test_an_inflight_session_ends_when_its_model_unloads(runtime):
    async def scenario():
        session = await runtime.runs.create_session("alice", {})
        info = await runtime.training.create_model(
            "alice", spec=LoraSpec(rank=4, alpha=8, seed=0), session_id=session)
        model_id = info.entry.model_id
        inflight = await runtime.sampling.snapshot("alice", OpRef(model_id, 0), inflight=True)
        target = runtime.sampling.target("alice", None, inflight)
        assert len((await runtime.sampling.sample(target, PROMPT, 1, GREEDY)).sequences) == 1
        await runtime.lifetimes.unload(model_id, "test")
        assert inflight not in runtime.samplers
        with pytest.raises(NotFound, match="sampling_session_id"):
            runtime.sampling.target("alice", None, inflight)
        with pytest.raises(NotFound, match="sampling session"):
            await runtime.sampling.sample(target, PROMPT, 1, GREEDY)

    asyncio.run(scenario())
