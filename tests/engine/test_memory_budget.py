"""A model with a memory budget (`memory_gib` in a models file: `EngineLimits.memory_bytes`)
sizes what it takes from free memory within it, so models can share a device."""

from __future__ import annotations

import numpy as np
import pytest

from twinkle_server.engine import memory
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import ResourceExhausted
from twinkle_server.engine.types import EngineLimits, LoraSpec

MIB = 1 << 20


def test_the_kv_pool_and_adapters_fit_the_budget_left_by_the_weights(tiny_cache):
    plain = Engine.load("tiny", cache_dir=str(tiny_cache))
    weights = memory.module_bytes(plain.base.model)
    budget = weights + 4 * MIB
    engine = Engine.load("tiny", cache_dir=str(tiny_cache),
                         limits=EngineLimits(memory_bytes=budget))
    per_token = memory.kv_bytes_per_token(engine.base.config, engine.base.dtype)
    # The pool takes its quarter of the 4 MiB left, not of the host's free memory.
    assert engine.limits.kv_pool_tokens == int(4 * MIB * memory.KV_SHARE) // per_token
    assert engine.limits.kv_pool_tokens < plain.limits.kv_pool_tokens
    engine.add_adapter("small", LoraSpec(rank=4, alpha=8, seed=0))   # ~0.3 MiB of state
    with pytest.raises(ResourceExhausted, match="MiB are free"):
        engine.add_adapter("large", LoraSpec(rank=128, alpha=8, seed=0))


def test_checkpoint_weight_bytes_counts_the_headers_in_the_dtype_asked(tiny_cache):
    import torch

    from twinkle_server.engine.base_model import model_dir

    engine = Engine.load("tiny", cache_dir=str(tiny_cache))
    directory = model_dir("tiny", tiny_cache)
    assert memory.checkpoint_weight_bytes(directory, torch.float32) == \
        memory.module_bytes(engine.base.model) - sum(
            b.numel() * b.element_size() for b in engine.base.model.buffers())
    assert memory.checkpoint_weight_bytes(directory, torch.bfloat16) * 2 == \
        memory.checkpoint_weight_bytes(directory, torch.float32)


def test_a_split_models_trainer_ranks_hold_no_kv_pool_and_give_its_budget_to_adapters(
        tmp_path, tiny_cache):
    """`sampler_ranks`: the trainer ranks never sample, so the pool the table asks for is
    not counted against their budget (it is the sampler ranks'); the sampler ranks' copy
    still holds it."""
    from twinkle_server.config.flags import ServerConfig
    from twinkle_server.engine.errors import FailedPrecondition
    from twinkle_server.engine.parallel import OneRank
    from twinkle_server.engine.types import SampleRequest, SamplingParams
    from twinkle_server.ranks.launch import load_engine

    plain = Engine.load("tiny", cache_dir=str(tiny_cache))
    weights = memory.module_bytes(plain.base.model)
    per_token = memory.kv_bytes_per_token(plain.base.config, plain.base.dtype)
    pool = 80 * MIB // per_token                          # a pool of 80 MiB
    models = tmp_path / "models.toml"
    models.write_text(f"""
[[models]]
name = "tiny"
path = "tiny"
sampler_ranks = 1
kv_pool_tokens = {pool}
max_seq_len = 128
max_pass_tokens = 128
memory_gib = {(weights + 40 * MIB) / 2**30!r}
""")
    config = ServerConfig(models=models, device="cpu")
    (model,) = config.model_configs()
    trainer = load_engine(config, model, OneRank())
    # ~0.6 MiB of state and 13 MiB for a pass of 128 tokens: within the 40 MiB left.
    trainer.add_adapter("small", LoraSpec(rank=4, alpha=8, seed=0))
    with pytest.raises(FailedPrecondition, match="sampler ranks"):
        trainer.decode([SampleRequest(None, None, np.array([5, 6]), 1,
                                      SamplingParams(max_tokens=2))], [0], 0.0)
    sampler = load_engine(config, model, device="cpu")
    assert sampler.limits.kv_pool_tokens == pool
    with pytest.raises(ResourceExhausted, match="MiB are free"):
        sampler.add_adapter("small", LoraSpec(rank=4, alpha=8, seed=0))
