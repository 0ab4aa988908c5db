"""The runtime's session and checkpoint verbs in-process: publishing opens a checkpoint
to every tenant for reading only, a checkpoint's time to live ends in the expiry sweep,
access tokens name their tenant and die with their key, and the session listing comes
from the store."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from twinkle_server.engine.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from twinkle_server.engine.types import TINKER_SWITCHES, LoraSpec
from twinkle_server.runtime import CheckpointRef, OpRef, Runtime
from twinkle_server.runtime.runs import (
    MAX_CHECKPOINT_TTL_SECONDS,
    MIN_CHECKPOINT_TTL_SECONDS,
    run_switches,
)
from twinkle_server.runtime.training import spec_to_json


async def _saved(rt: Runtime, names: tuple[str, ...], kind: str = "training",
                 tenant: str = "alice") -> list[CheckpointRef]:
    """A new model of `tenant` and a checkpoint of it under each name."""
    info = await rt.training.create_model(tenant, spec=LoraSpec(rank=4, alpha=8, seed=0))
    mid = info.entry.model_id
    refs = []
    for seq, name in enumerate(names):
        row = await rt.training.save(tenant, OpRef(mid, seq), kind, name)
        text = f"tinker://{mid}/{row.checkpoint_id}"
        refs.append(CheckpointRef(mid, kind, name, text))
    return refs


def test_a_published_checkpoint_is_readable_by_every_tenant_and_changeable_only_by_its_owner(
        runtime):
    runs = runtime.runs

    async def scenario():
        (ref,) = await _saved(runtime, ("shared",))
        (sampler_ref,) = await _saved(runtime, ("shared-s",), kind="sampler")
        for attempt in (lambda: runs.get_checkpoint("bob", ref),
                        lambda: runs.checkpoint_files("bob", ref)):
            with pytest.raises(NotFound, match="no checkpoint"):
                attempt()
        with pytest.raises(NotFound, match="no checkpoint"):
            await runtime.training.create_model("bob", spec=None, from_checkpoint=ref)

        await runs.publish_checkpoint("alice", ref, public=True)
        await runs.publish_checkpoint("alice", sampler_ref, public=True)
        row, run = runs.get_checkpoint("bob", ref)
        assert row.public and run.base_model == "tiny" and run.lora["rank"] == 4
        assert "adapter_config.json" in runs.checkpoint_files("bob", ref)[1]
        loaded = await runtime.training.create_model("bob", spec=None, from_checkpoint=ref)
        assert loaded.entry.tenant == "bob" and loaded.spec.rank == 4
        await runtime.sampling.create_session("bob", model_path=sampler_ref)
        # Bob reads it; only alice changes it.
        with pytest.raises(NotFound, match="no checkpoint"):
            await runs.delete_checkpoint("bob", ref)
        with pytest.raises(NotFound, match="no checkpoint"):
            await runs.publish_checkpoint("bob", ref, public=False)
        with pytest.raises(NotFound, match="no checkpoint"):
            await runs.set_checkpoint_ttl("bob", ref, 3600)
        with pytest.raises(FailedPrecondition, match="already public"):
            await runs.publish_checkpoint("alice", ref, public=True)
        # Bob's listing is his own checkpoints only, published or not.
        assert runs.list_checkpoints("bob").total == 0

        await runs.publish_checkpoint("alice", ref, public=False)
        with pytest.raises(NotFound, match="no checkpoint"):
            runs.get_checkpoint("bob", ref)
        with pytest.raises(FailedPrecondition, match="already private"):
            await runs.publish_checkpoint("alice", ref, public=False)

    asyncio.run(scenario())


def test_a_ttl_outside_one_hour_to_ten_years_is_refused_naming_the_field_and_range(runtime):
    async def scenario():
        (ref,) = await _saved(runtime, ("short",))
        for ttl in (0, MIN_CHECKPOINT_TTL_SECONDS - 1, MAX_CHECKPOINT_TTL_SECONDS + 1):
            with pytest.raises(InvalidArgument, match=r"ttl_seconds: .* give 3600 \(1 hour\) "
                                                      r"to 315360000 \(10 years\)"):
                await runtime.runs.set_checkpoint_ttl("alice", ref, ttl)
        expires = await runtime.runs.set_checkpoint_ttl("alice", ref, MAX_CHECKPOINT_TTL_SECONDS)
        assert expires == pytest.approx(time.time() + MAX_CHECKPOINT_TTL_SECONDS, abs=60)
        assert await runtime.runs.set_checkpoint_ttl("alice", ref, None) is None
        row, _ = runtime.runs.get_checkpoint("alice", ref)
        assert row.expires_at is None

    asyncio.run(scenario())


def test_the_sweep_deletes_expired_checkpoints_files_and_record_and_spares_the_rest(runtime):
    async def scenario():
        hour, day, forever = await _saved(runtime, ("hour", "day", "forever"))
        await runtime.runs.set_checkpoint_ttl("alice", hour, 3600)
        await runtime.runs.set_checkpoint_ttl("alice", day, 86400)
        directory = runtime.runs.checkpoint_files("alice", hour)[0]
        await runtime.lifetimes.expire_checkpoints(now=time.time() + 1800)
        assert runtime.runs.list_checkpoints("alice").total == 3
        await runtime.lifetimes.expire_checkpoints(now=time.time() + 7200)
        names = [row.name for row, _ in runtime.runs.list_checkpoints("alice").items]
        assert sorted(names) == ["day", "forever"]
        assert not directory.exists()
        with pytest.raises(NotFound, match="no checkpoint"):
            runtime.runs.get_checkpoint("alice", hour)

    asyncio.run(scenario())


def test_a_checkpoint_saved_over_after_the_sweep_read_it_survives_the_sweep(runtime):
    async def scenario():
        (ref,) = await _saved(runtime, ("again",))
        await runtime.runs.set_checkpoint_ttl("alice", ref, 3600)
        later = time.time() + 7200
        (expired,) = runtime.store.expired_checkpoints(later)
        await runtime.training.save("alice", OpRef(ref.run_id, 1), "training", "again",
                                    overwrite=True)
        assert not await runtime.drop_checkpoint(expired, expired_by=later)
        row, directory = runtime.checkpoint("alice", ref)
        assert row.expires_at is None and directory.is_dir()

    asyncio.run(scenario())


def test_the_session_listing_has_every_session_of_the_tenant_newest_first(runtime):
    async def scenario():
        runs = runtime.runs
        first = await runs.create_session("alice", {})
        await runs.create_session("bob", {})
        second = await runs.create_session("alice", {})
        await runs.close_session("alice", first)
        page = runs.list_sessions("alice")
        assert [s.session_id for s in page.items] == [second, first] and page.total == 2
        assert [s.session_id for s in runs.list_sessions("alice", 1, 1).items] == [first]
        closed = runs.get_session("alice", first)
        assert closed.session.closed_at is not None and closed.run_ids == []
        with pytest.raises(NotFound, match="no session"):
            runs.get_session("bob", first)

    asyncio.run(scenario())


def test_weights_info_switches_are_from_tinkers_own_and_claimed_for_no_other_run(runtime):
    """`run_switches` gives back exactly the switches `LoraSpec.from_tinker` took; a run
    made otherwise claims none: an import that adapts only MoE expert parameters (PEFT's
    `target_parameters`, no linear module) stores no target module, and is not a run
    made with every switch off (which is refused)."""
    store = runtime.store
    made = [dict(zip(TINKER_SWITCHES, bits, strict=True))
            for bits in itertools.product((True, False), repeat=3) if any(bits)]
    for n, switches in enumerate(made):
        spec = LoraSpec.from_tinker(4, **switches)
        run = store.create_run(f"run-{n}", "alice", "tiny", spec_to_json(spec), {}, None)
        assert run_switches(run) == switches
    # What `imports.register` stores for a PEFT adapter of expert parameters only.
    experts_only = store.create_run("run-experts", "alice", "tiny", {
        "rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": [], "use_rslora": False,
        "target_parameters": ["model.layers.0.mlp.experts.gate_up_proj"], "seed": None},
        {}, None)
    assert run_switches(experts_only) == {}


def test_a_run_resumed_from_a_tinker_runs_checkpoint_keeps_its_switches(runtime):
    """`create_training_client_from_state` of a run made with train_mlp=False trains the
    same roles; its weights info says so, as the first run's does."""
    switches = {"train_attn": True, "train_mlp": False, "train_unembed": True}

    async def scenario():
        info = await runtime.training.create_model("alice", spec=LoraSpec.from_tinker(
            4, seed=0, **switches))
        first = info.entry.model_id
        await runtime.training.save("alice", OpRef(first, 0), "training", "s")
        resumed = await runtime.training.create_model(
            "alice", spec=None, from_checkpoint=CheckpointRef(
                first, "training", "s", f"tinker://{first}/weights/s"))
        return first, resumed.entry.model_id

    first, resumed = asyncio.run(scenario())
    assert run_switches(runtime.store.get_run("alice", first)) == switches
    assert run_switches(runtime.store.get_run("alice", resumed)) == switches
