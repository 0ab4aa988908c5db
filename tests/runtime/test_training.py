"""The runtime's training verbs in-process, with the real tiny engine and store and no
gRPC: ops of a model run against the state its earlier ops left, in seq order, however
long the worker is busy; refusals take their seq_id; ownership hides other tenants'."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from twinkle_server.config.flags import ServerConfig
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import FailedPrecondition, InvalidArgument, NotFound
from twinkle_server.engine.types import Datum, EngineLimits, LoraSpec, LossSpec
from twinkle_server.runtime import OpRef, Runtime
from twinkle_server.store import Store

from .conftest import running


def _datums(n: int = 2, length: int = 8) -> list[Datum]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        ids = rng.integers(3, 200, length + 1)
        out.append(Datum(ids[:-1], {"target_tokens": ids[1:],
                                    "weights": np.ones(length, np.float32)}))
    return out


async def _model(rt: Runtime, tenant: str = "alice") -> str:
    info = await rt.training.create_model(tenant, spec=LoraSpec(rank=4, alpha=8, seed=0))
    return info.entry.model_id


async def _hold_worker(rt: Runtime) -> tuple[asyncio.Future, threading.Event]:
    """Occupy the worker with an admin op until the returned event is set; returns once
    the worker holds it (nothing queued after it can have run yet) with the op's future."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait()

    busy = asyncio.ensure_future(rt.admin("hold the worker", hold))
    assert await asyncio.to_thread(holding.wait, 60), "the worker never took the op"
    return busy, release


def test_set_loss_queued_behind_a_busy_worker_is_the_loss_the_next_forward_runs_with(
        runtime):
    async def scenario():
        mid = await _model(runtime)
        busy, release = await _hold_worker(runtime)
        set_loss = asyncio.ensure_future(runtime.training.set_loss(
            "alice", OpRef(mid, 0), LossSpec("CrossEntropyLoss")))
        # Built (and checked) while set_loss still waits behind the held worker.
        request = runtime.training.forward_request("alice", mid, _datums(), None, True)
        forward = asyncio.ensure_future(runtime.training.forward("alice", OpRef(mid, 1),
                                                                 request))
        await asyncio.sleep(0.2)
        assert not set_loss.done() and not forward.done()
        release.set()
        await busy
        await set_loss
        return await forward

    out = asyncio.run(scenario())
    assert "loss:mean" in out.metrics and "loss:sum" not in out.metrics


def test_forward_with_no_loss_anywhere_is_refused_in_its_op_and_later_seqs_still_run(
        runtime):
    async def scenario():
        mid = await _model(runtime)
        request = runtime.training.forward_request("alice", mid, _datums(), None, True)
        with pytest.raises(FailedPrecondition, match="none set with set_loss"):
            await runtime.training.forward("alice", OpRef(mid, 0), request)
        await runtime.training.set_loss("alice", OpRef(mid, 1), LossSpec("cross_entropy"))
        return await runtime.training.forward("alice", OpRef(mid, 2), request)

    assert "loss:sum" in asyncio.run(scenario()).metrics


def test_a_request_refused_before_it_queues_takes_its_seq_id(runtime):
    async def scenario():
        mid = await _model(runtime)
        with pytest.raises(InvalidArgument, match="the batch is empty"):
            runtime.training.forward_request("alice", mid, [], None, True)
        with pytest.raises(InvalidArgument, match="bad name"):
            await runtime.training.refuse("alice", OpRef(mid, 0), "forward",
                                          InvalidArgument("bad name"))
        await runtime.training.set_loss("alice", OpRef(mid, 1), LossSpec("cross_entropy"))
        return await runtime.training.get_train_configs("alice", OpRef(mid, 2))

    assert asyncio.run(scenario())["loss"]["name"] == "cross_entropy"


def test_another_tenants_model_looks_like_no_model(runtime):
    async def scenario():
        mid = await _model(runtime, "alice")
        with pytest.raises(NotFound, match="no model"):
            await runtime.training.set_loss("bob", OpRef(mid, 0), LossSpec("cross_entropy"))
        with pytest.raises(NotFound, match="no model"):
            runtime.training.info("bob", mid)

    asyncio.run(scenario())


@pytest.fixture
def two_slots(tiny_cache, tmp_path):
    engine = Engine.load("tiny", cache_dir=str(tiny_cache), limits=EngineLimits(max_adapters=2))
    yield from running(Runtime(ServerConfig(data_dir=tmp_path), engine, Store(tmp_path)))


def test_a_merged_pass_takes_resident_runs_first_and_pages_in_only_what_it_runs(two_slots):
    """Four runs' forward_backwards queued at once on two slots, where c and d are
    resident: the first pass is a (its turn) with the resident c, paging in a alone; the
    second b and d. Three page-ins, where one batch of all four ran as two passes that
    paged out c and d and then back in (four)."""
    rt = two_slots

    async def scenario() -> tuple[int, list[float]]:
        runs = [await _model(rt) for _ in range(4)]
        for mid in runs:
            await rt.training.set_loss("alice", OpRef(mid, 0), LossSpec("cross_entropy"))
        engine = rt.base_of(runs[0]).engine
        assert engine.paging_stats().resident_ids == set(runs[2:])
        before = engine.paging_stats().page_ins
        busy, release = await _hold_worker(rt)
        forwards = [asyncio.ensure_future(rt.training.forward(
            "alice", OpRef(mid, 1), rt.training.forward_request("alice", mid, _datums(), None,
                                                                True))) for mid in runs]
        await asyncio.sleep(0.2)
        release.set()
        await busy
        losses = [out.loss for out in await asyncio.gather(*forwards)]
        return engine.paging_stats().page_ins - before, losses

    page_ins, losses = asyncio.run(scenario())
    assert page_ins == 3
    assert all(np.isfinite(loss) for loss in losses)


def test_a_retry_answered_from_the_stored_result_is_not_observed_again(runtime):
    """/metrics counts ops and tokens through `observe_op`: a retried seq_id, answered
    with the first call's result and nothing run, must not count again."""
    seen = []
    runtime.observe_op = lambda base, op, seconds, result, error: seen.append(op.kind)

    async def scenario():
        mid = await _model(runtime)
        await runtime.training.set_loss("alice", OpRef(mid, 0), LossSpec("cross_entropy"))
        request = runtime.training.forward_request("alice", mid, _datums(), None, True)
        first = await runtime.training.forward("alice", OpRef(mid, 1), request)
        for _ in range(3):
            again = await runtime.training.forward("alice", OpRef(mid, 1), request)
            assert again is first
    asyncio.run(scenario())
    assert seen.count("forward_backward") == 1, seen


def _timing_out(engine: Engine, tmp_path, timeout: float) -> Runtime:
    """A runtime whose sessions expire after `timeout` seconds without a sign of life."""
    return Runtime(ServerConfig(data_dir=tmp_path, session_timeout=timeout), engine,
                   Store(tmp_path))


async def _session_model(rt: Runtime) -> str:
    """A model of alice's in a new client session (its id)."""
    session = await rt.runs.create_session("alice", {})
    info = await rt.training.create_model("alice", session_id=session,
                                          spec=LoraSpec(rank=4, alpha=8, seed=0))
    return info.entry.model_id


def test_a_sessions_ops_keep_it_alive_between_heartbeats(engine, tmp_path):
    """The stock SDK heart-beats every 10 s: a loop training without pause under a
    shorter --session-timeout must keep its model; its ops count as liveness, and a
    session idle past the timeout still expires."""
    timeout = 2.0
    rt = _timing_out(engine, tmp_path, timeout)

    async def scenario():
        mid = await _session_model(rt)
        await asyncio.sleep(timeout + 0.5)   # no heartbeat since the session opened
        await rt.training.set_loss("alice", OpRef(mid, 0), LossSpec("cross_entropy"))
        await rt.lifetimes.expire_sessions()
        assert mid in rt.models, "a session expired right after its model's op"
        await asyncio.sleep(timeout + 0.5)
        await rt.lifetimes.expire_sessions()
        assert mid not in rt.models, "an idle session did not expire"

    for _ in running(rt):
        asyncio.run(scenario())


def test_a_session_whose_op_waits_past_the_timeout_is_not_expired_under_it(engine, tmp_path):
    """An op queued behind a long one (another tenant's) may wait longer than
    --session-timeout: its session is alive while it waits, and its model stays for it;
    the timeout counts from its end."""
    timeout = 1.0
    rt = _timing_out(engine, tmp_path, timeout)

    async def scenario():
        mid = await _session_model(rt)
        busy, release = await _hold_worker(rt)
        try:
            queued = asyncio.ensure_future(rt.training.set_loss(
                "alice", OpRef(mid, 0), LossSpec("cross_entropy")))
            await asyncio.sleep(timeout + 0.5)
            # Expiring it would unload its model, an op behind the held one: a bound.
            await asyncio.wait_for(rt.lifetimes.expire_sessions(), 30)
            assert rt.store.open_sessions("alice") == 1, \
                "a session expired while its op waited in the queue"
        finally:
            release.set()
        await busy
        await queued
        await rt.lifetimes.expire_sessions()
        assert mid in rt.models, "a session expired right after its op ended"

    for _ in running(rt):
        asyncio.run(scenario())


def test_a_session_whose_op_waits_for_a_seq_id_its_client_never_sent_still_expires(
        engine, tmp_path):
    """An op that can run only once its own client sends the seq_id before it (an HTTP
    future's task outlives the client that posted it) waits on nothing but that client:
    a client gone quiet past --session-timeout loses its session and its model's slot,
    and the op fails, as when nothing of it was queued."""
    timeout = 1.0
    rt = _timing_out(engine, tmp_path, timeout)

    async def scenario():
        mid = await _session_model(rt)
        # seq 1 posted, seq 0 lost with its client: seq 1 can never run.
        stranded = asyncio.ensure_future(rt.training.set_loss(
            "alice", OpRef(mid, 1), LossSpec("cross_entropy")))
        await asyncio.sleep(timeout + 0.5)
        await asyncio.wait_for(rt.lifetimes.expire_sessions(), 30)
        try:
            assert rt.store.open_sessions("alice") == 0, \
                "a session with no heartbeat nor runnable op was never expired"
            assert mid not in rt.models
            with pytest.raises(FailedPrecondition, match="unloaded"):
                await asyncio.wait_for(stranded, 30)
        finally:
            stranded.cancel()

    for _ in running(rt):
        asyncio.run(scenario())
