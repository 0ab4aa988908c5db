"""The pass headroom `add_adapter` keeps free beside every adapter's state (`engine.memory`):
counted once per engine from its limits (the largest piece of a pass: `--max-pass-tokens`,
or without it `--max-batch-tokens`), and named in the refusal with a fix."""

from __future__ import annotations

import copy

import pytest
import torch

from twinkle_server.engine import logprobs, memory
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import InvalidArgument, ResourceExhausted
from twinkle_server.engine.types import EngineLimits, LoraSpec


def test_tiny_layer_count_is_the_documented_multiple(engine):
    # Tiny: H 128, Q 4 x 32 = 128, K 2 x 32 = 64, I 384.
    # kept 4H + 6Q + K + 4I = 512 + 768 + 64 + 1536; float32 copies 7H + 2Q + K + I.
    assert memory.layer_elements(engine.base.config) == [(2880, 896 + 256 + 64 + 384)] * 4


def test_headroom_grows_with_max_batch_tokens(engine):
    config, vocab = engine.base.config, engine.base.vocab_size
    sizes = [memory.pass_headroom_bytes(config, torch.float32, vocab, tokens)
             for tokens in (1024, 4096, 262_144)]
    assert sizes[0] < sizes[1] < sizes[2]
    per_token = memory.activation_bytes_per_token(config, torch.float32)
    # Activations are linear in tokens; the logits term stops at one chunk.
    chunk = logprobs.chunk_tokens(vocab)
    assert sizes[2] - sizes[1] == (262_144 - 4096) * per_token + 4 * (chunk - 4096) * vocab * 4


def test_checkpointing_and_dtype_change_the_per_token_bound(engine):
    config = engine.base.config
    full = memory.activation_bytes_per_token(config, torch.float32)
    # Checkpointing never raises the bound; on 4 layers its margin leaves it the same, on
    # 36 (Qwen3-4B's depth) it keeps well under half.
    assert memory.activation_bytes_per_token(config, torch.float32, checkpointing=True) == full
    deep = copy.deepcopy(config)
    deep.num_hidden_layers = 36
    deep.layer_types = ["full_attention"] * 36
    assert (2 * memory.activation_bytes_per_token(deep, torch.float32, checkpointing=True)
            < memory.activation_bytes_per_token(deep, torch.float32))
    # bf16 keeps half-size activations, but LoRA inputs and RMSNorms are upcast to float32.
    assert full / 2 < memory.activation_bytes_per_token(config, torch.bfloat16)


def test_engine_counts_headroom_once_from_its_own_limits(engine, tiny_cache):
    small = Engine.load("tiny", cache_dir=str(tiny_cache),
                        limits=EngineLimits(max_batch_tokens=512))
    spec = LoraSpec(rank=4, alpha=8)
    assert small.pass_headroom_bytes < engine.pass_headroom_bytes
    assert engine.pass_headroom_bytes == memory.pass_headroom_bytes(
        engine.base.config, engine.base.dtype, engine.base.vocab_size,
        engine.limits.max_batch_tokens)
    # The adapter's own estimate does not depend on the pass.
    assert small.estimate_adapter_bytes(spec) == engine.estimate_adapter_bytes(spec)


def test_refusal_names_the_pass_headroom_and_the_fix(engine, fresh, monkeypatch):
    import twinkle_server.engine.engine as engine_module

    spec = LoraSpec(rank=4, alpha=8, seed=1)
    monkeypatch.setattr(engine, "reserve_pass_memory", True)  # as on an accelerator
    need = engine.estimate_adapter_bytes(spec) + engine.pass_headroom_bytes
    monkeypatch.setattr(engine_module, "available_memory_bytes", lambda device: need - 1)
    headroom_mib = f"{engine.pass_headroom_bytes / 2**20:.1f}"
    with pytest.raises(ResourceExhausted, match=(
            rf"plus {headroom_mib} MiB pass headroom \(activations and logits of a 4096-token "
            r"pass\) but only .* MiB are free; use a smaller rank or fewer target modules, "
            r"or a lower --max-pass-tokens")):
        engine.add_adapter("tight", spec)
    assert "tight" not in engine.adapters
    # Exactly enough: state plus headroom fit.
    monkeypatch.setattr(engine_module, "available_memory_bytes", lambda device: need)
    engine.add_adapter("tight", spec)
    fresh.append("tight")


def test_cpu_engines_without_a_pass_cap_report_the_headroom_without_reserving_it(
        engine, fresh, monkeypatch):
    import twinkle_server.engine.engine as engine_module

    assert engine.base.device.type == "cpu" and not engine.reserve_pass_memory
    spec = LoraSpec(rank=4, alpha=8, seed=2)
    monkeypatch.setattr(engine_module, "available_memory_bytes",
                        lambda device: engine.estimate_adapter_bytes(spec))
    engine.add_adapter("host", spec)
    fresh.append("host")


def test_a_pass_cap_bounds_the_headroom_and_is_reserved_even_on_cpu(engine, tiny_cache):
    capped = Engine.load("tiny", cache_dir=str(tiny_cache),
                         limits=EngineLimits(max_seq_len=2048, max_batch_tokens=262_144,
                                             max_pass_tokens=2048))
    assert capped.pass_headroom_bytes == memory.pass_headroom_bytes(
        capped.base.config, capped.base.dtype, capped.base.vocab_size, 2048)
    assert capped.base.device.type == "cpu" and capped.reserve_pass_memory


def test_a_pass_cap_under_the_longest_datum_is_refused(tiny_cache):
    with pytest.raises(InvalidArgument, match="max_pass_tokens: 100 is under the 256-token "
                                              "--max-seq-len"):
        Engine.load("tiny", cache_dir=str(tiny_cache),
                    limits=EngineLimits(max_seq_len=256, max_pass_tokens=100))


def test_the_fitted_pass_is_the_largest_whose_headroom_fits_the_budget(engine):
    config, vocab = engine.base.config, engine.base.vocab_size
    for budget in (2**26, 2**30, 5 * 2**30):
        tokens = memory.fit_pass_tokens(config, torch.bfloat16, vocab, budget)
        assert memory.pass_headroom_bytes(config, torch.bfloat16, vocab, tokens) <= budget
        assert memory.pass_headroom_bytes(config, torch.bfloat16, vocab, tokens + 1) > budget


def test_auto_pass_tokens_is_fixed_on_cpu_and_fits_half_the_free_memory_elsewhere(engine):
    config, vocab = engine.base.config, engine.base.vocab_size
    assert memory.auto_pass_tokens(config, torch.float32, vocab, "cpu", 10**12, 256) == 16_384
    assert memory.auto_pass_tokens(config, torch.float32, vocab, "cpu", None, 32_768) == 32_768
    free, gathered = 8 * 2**30, 2**30
    tokens = memory.auto_pass_tokens(config, torch.bfloat16, vocab, "cuda", free, 256,
                                     gathered=gathered)
    assert tokens == memory.fit_pass_tokens(config, torch.bfloat16, vocab,
                                            free // 2 - gathered)
    with pytest.raises(InvalidArgument, match=r"--max-seq-len 4096 tokens, whose activations "
                                              r"need .* GiB, but 50% of the 0.1 GiB free"):
        memory.auto_pass_tokens(config, torch.bfloat16, vocab, "cuda", 2**27, 4096)


def test_an_engine_left_to_pick_caps_its_passes_and_reserves_the_headroom(tiny_cache):
    from twinkle_server.engine.types import AUTO_PASS_TOKENS

    picked = Engine.load("tiny", cache_dir=str(tiny_cache),
                         limits=EngineLimits(max_pass_tokens=AUTO_PASS_TOKENS))
    assert picked.limits.max_pass_tokens == memory.CPU_PASS_TOKENS
    assert picked.reserve_pass_memory


def test_cuda_free_memory_counts_the_allocators_unused_cache_as_free(monkeypatch):
    # No GPU here: torch.cuda's three probes stand in for a device after a large pass,
    # whose 6 GiB of blocks the allocator keeps cached though only 1 GiB is in use.
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 1 * gib)
    assert memory.available_memory_bytes(torch.device("cuda", 0)) == 15 * gib


def _qwen3(hidden: int, inter: int, layers: int, heads: int):
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=8, head_dim=128,
                       vocab_size=151_936)


def test_auto_checkpointing_turns_on_only_where_one_long_datum_would_not_fit():
    gib, vocab, bf16 = 2**30, 151_936, torch.bfloat16
    small, large = _qwen3(1024, 3072, 28, 16), _qwen3(2560, 9728, 36, 32)  # Qwen3-0.6B, -4B
    # One 141 GB device less the base: without it, a pass of the 0.6B holds about 14,400
    # tokens, the 4B's about 4,400.
    free_small, free_large = 137 * gib, 132 * gib
    assert not memory.auto_checkpointing(small, bf16, vocab, "cuda", free_small, 8192)
    assert memory.auto_checkpointing(small, bf16, vocab, "cuda", free_small, 16_384)
    assert not memory.auto_checkpointing(large, bf16, vocab, "cuda", free_large, 4096)
    assert memory.auto_checkpointing(large, bf16, vocab, "cuda", free_large, 8192)
    # An 80 GB device: the 4B holds about 2,400 tokens.
    assert memory.auto_checkpointing(large, bf16, vocab, "cuda", 72 * gib, 4096)
    # Gathered weights on several ranks come out of the same budget.
    assert memory.auto_checkpointing(small, bf16, vocab, "cuda", free_small, 8192,
                                     gathered=40 * gib)
    assert not memory.auto_checkpointing(large, torch.float32, vocab, "cpu", gib, 4096)
    assert not memory.auto_checkpointing(large, bf16, vocab, "cuda", None, 4096)


def test_an_engine_left_to_pick_checkpointing_leaves_it_off_on_cpu(tiny_cache):
    picked = Engine.load("tiny", cache_dir=str(tiny_cache), activation_checkpointing=None)
    assert picked.activation_checkpointing is False
