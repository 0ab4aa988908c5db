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
