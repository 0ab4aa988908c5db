"""Uploads in-process (`runtime.imports`): one never finished is removed once it expires,
and an expired one can no longer be finished."""

from __future__ import annotations

import asyncio
import time

import pytest

from twinkle_server.engine.errors import NotFound

LORA = {"rank": 4, "train_mlp": True, "train_attn": True, "train_unembed": True}


def test_an_upload_never_finished_is_removed_once_it_expires(runtime):
    async def scenario():
        started = await runtime.imports.start("alice", "tiny", LORA)
        folder = runtime.imports.root / started.upload_id
        assert folder.is_dir()
        await runtime.imports.expire(now=time.time())          # not yet
        assert folder.is_dir()
        await runtime.imports.expire(now=started.expires + 1)  # past its URLs' expiry
        assert not folder.exists()
        with pytest.raises(NotFound, match="no upload"):
            await runtime.imports.finish("alice", started.upload_id)
    asyncio.run(scenario())


def test_an_upload_is_its_tenants_alone(runtime):
    async def scenario():
        started = await runtime.imports.start("alice", "tiny", LORA)
        with pytest.raises(NotFound, match="no upload"):
            await runtime.imports.finish("bob", started.upload_id)
        with pytest.raises(NotFound, match="no upload"):
            await runtime.imports.finish("alice", "upl-../../etc")
    asyncio.run(scenario())


def test_an_upload_adapts_only_the_roles_its_switches_announced(tiny_cache, tmp_path):
    """phi3's fused `gate_up_proj` is MLP and its `qkv_proj` attention, as the switches
    select them when training (`engine.roles`), whatever their names."""
    from twinkle_server.engine.adapter_import import ImportedAdapter, base_linears
    from twinkle_server.engine.errors import InvalidArgument
    from twinkle_server.engine.types import LoraSpec
    from twinkle_server.runtime.imports import _agree

    from ..engine.families import write_family

    roles = base_linears(write_family(tmp_path, "phi3", tiny_cache)).roles
    modules = ("model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj")
    adapter = ImportedAdapter(LoraSpec(rank=4, alpha=8), modules, {},
                              {m: roles[m] for m in modules})
    _agree(adapter, LORA)
    with pytest.raises(InvalidArgument, match="adapts 'model.layers.0.mlp.gate_up_proj', "
                                              "but the upload was started with "
                                              "lora_config.train_mlp false"):
        _agree(adapter, {**LORA, "train_mlp": False})
    with pytest.raises(InvalidArgument, match="lora_config.train_attn false"):
        _agree(adapter, {**LORA, "train_attn": False})
