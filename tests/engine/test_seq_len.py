"""`--max-seq-len`: by default (0) the model's `max_position_embeddings`, at most
`--max-batch-tokens`, a given `--max-pass-tokens` and what memory allows, and logged; a
value given above the model's context is refused naming both numbers."""

from __future__ import annotations

import logging

import pytest
import torch

from twinkle_server.config.flags import ServerConfig
from twinkle_server.engine import memory
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import AUTO_SEQ_LEN, EngineLimits
from twinkle_server.runtime import Runtime
from twinkle_server.store import Store

TINY_CONTEXT = 4096
"""The tiny model's `max_position_embeddings` (`engine.tiny_model.RECIPE`)."""


def test_the_default_is_the_models_context_bounded_by_the_request_and_pass_limits(
        tiny_cache, caplog):
    assert ServerConfig().max_seq_len == AUTO_SEQ_LEN
    with caplog.at_level(logging.INFO, logger="twinkle_server.engine.engine"):
        engine = Engine.load("tiny", cache_dir=str(tiny_cache),
                             limits=EngineLimits(max_seq_len=AUTO_SEQ_LEN))
    assert engine.base.config.max_position_embeddings == TINY_CONTEXT
    assert engine.limits.max_seq_len == TINY_CONTEXT
    assert f"sequences of at most {TINY_CONTEXT} tokens (--max-seq-len 0" in caplog.text
    for limits, want in ((EngineLimits(max_seq_len=AUTO_SEQ_LEN, max_batch_tokens=1000), 1000),
                         (EngineLimits(max_seq_len=AUTO_SEQ_LEN, max_pass_tokens=512), 512)):
        assert Engine.load("tiny", cache_dir=str(tiny_cache),
                           limits=limits).limits.max_seq_len == want


def test_the_runtime_serves_the_length_the_engine_chose(tiny_cache, tmp_path):
    engine = Engine.load("tiny", cache_dir=str(tiny_cache),
                         limits=EngineLimits(max_seq_len=AUTO_SEQ_LEN, max_batch_tokens=3000))
    store = Store(tmp_path)
    rt = Runtime(ServerConfig(data_dir=tmp_path, max_batch_tokens=3000), engine, store)
    try:
        assert rt.bases.default.model.max_seq_len == 3000
        assert rt.runs.capabilities()["models"][0]["max_context_length"] == 3000
    finally:
        rt.close()
        store.close()


def test_a_length_over_the_models_context_is_refused_naming_both(tiny_cache):
    with pytest.raises(InvalidArgument, match=r"--max-seq-len 8192 is over the model's "
                                              rf"max_position_embeddings {TINY_CONTEXT}"):
        Engine.load("tiny", cache_dir=str(tiny_cache), limits=EngineLimits(max_seq_len=8192))
    assert Engine.load("tiny", cache_dir=str(tiny_cache), limits=EngineLimits(
        max_seq_len=TINY_CONTEXT)).limits.max_seq_len == TINY_CONTEXT


def test_on_an_accelerator_memory_bounds_it_and_on_cpu_the_cpu_pass_cap(tiny_cache):
    engine = Engine.load("tiny", cache_dir=str(tiny_cache))
    config, vocab = engine.base.config, engine.base.vocab_size
    big = 10**6
    assert memory.auto_max_seq_len(config, torch.float32, vocab, "cpu", 10**12, big,
                                   False) == memory.CPU_PASS_TOKENS
    assert memory.auto_max_seq_len(config, torch.float32, vocab, "cpu", None, 300,
                                   False) == 300
    free, gathered = 2**30, 2**26
    for checkpointing in (False, True):
        fitted = memory.fit_pass_tokens(config, torch.bfloat16, vocab,
                                        free // 2 - gathered, checkpointing)
        assert 0 < fitted < big
        assert memory.auto_max_seq_len(config, torch.bfloat16, vocab, "cuda", free, big,
                                       checkpointing, gathered) == fitted
        assert memory.auto_max_seq_len(config, torch.bfloat16, vocab, "cuda", free, 100,
                                       checkpointing, gathered) == 100
    assert memory.auto_max_seq_len(config, torch.bfloat16, vocab, "cuda", free, big, True) > \
        memory.auto_max_seq_len(config, torch.bfloat16, vocab, "cuda", free, big, False)
    with pytest.raises(InvalidArgument, match="holds no training pass"):
        memory.auto_max_seq_len(config, torch.bfloat16, vocab, "cuda", 2**10, big, False)
