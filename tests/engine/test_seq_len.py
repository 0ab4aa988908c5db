"""`--max-seq-len`: by default (0) the model's `max_position_embeddings`, at most
`--max-batch-tokens`, a given `--max-pass-tokens` and what memory allows, and logged; a
value given above the model's context is refused naming both numbers. A longrope model
(Phi-3.5, Phi-4-mini) is held to its `original_max_position_embeddings`, within which
every pass and the decode pool run its short factors."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import transformers

from twinkle_server.config.flags import ServerConfig
from twinkle_server.engine import memory
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import (
    AUTO_SEQ_LEN,
    EngineLimits,
    LoraSpec,
    LossSpec,
    SampleRequest,
    SamplingParams,
)
from twinkle_server.runtime import Runtime
from twinkle_server.store import Store

from ..numerics import LOGPROB_ATOL
from .families import random_datums, randomize_b, write_family

TINY_CONTEXT = 4096
"""The tiny model's `max_position_embeddings` (`engine.tiny_model.RECIPE`)."""


def test_the_default_is_the_models_context_bounded_by_the_request_and_pass_limits(
        tiny_cache, caplog):
    assert ServerConfig().max_seq_len == AUTO_SEQ_LEN
    with caplog.at_level(logging.INFO, logger="twinkle_server.engine.seq_len"):
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


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
            "short_factor": [1.0] * 8, "long_factor": [4.0 + i for i in range(8)],
            "original_max_position_embeddings": 32}
"""A Phi-3.5-style longrope over the tiny families' 16-wide heads (8 factors each): short
factors up to 32 tokens, long ones (far from them, so a switch shows) past it."""
CE = LossSpec("cross_entropy")


@pytest.fixture(scope="module")
def longrope(tiny_cache, tmp_path_factory):
    """A tiny Phi-3 with longrope (original 32, max_position_embeddings 512)."""
    return write_family(tmp_path_factory.mktemp("longrope"), "phi3", tiny_cache,
                        rope_parameters=LONGROPE, original_max_position_embeddings=32,
                        max_position_embeddings=512)


def _two_adapters(path, tiny_cache, max_seq_len=AUTO_SEQ_LEN) -> Engine:
    """The model at `path` with adapters "a" (trained-looking) and "b" (fresh)."""
    engine = Engine.load(str(path), cache_dir=str(tiny_cache), limits=EngineLimits(
        max_adapters=4, max_rank=16, max_seq_len=max_seq_len, max_batch_tokens=1024,
        kv_pool_tokens=512))
    engine.add_adapter("a", LoraSpec.from_tinker(8, seed=1))
    randomize_b(engine, "a", 3, 0.05)
    engine.add_adapter("b", LoraSpec.from_tinker(4, seed=2))
    return engine


def test_a_longrope_models_default_is_its_original_max_position_embeddings(
        longrope, tiny_cache, caplog):
    with caplog.at_level(logging.INFO, logger="twinkle_server.engine.seq_len"):
        engine = _two_adapters(longrope, tiny_cache)
    assert engine.base.config.max_position_embeddings == 512
    assert engine.limits.max_seq_len == 32
    assert "held to its 32-token original_max_position_embeddings" in caplog.text


def test_a_length_over_a_longrope_models_original_context_is_refused_naming_it(
        longrope, tiny_cache):
    with pytest.raises(InvalidArgument, match=r"max_seq_len: --max-seq-len 64 is over 32, "
                                              r"the original_max_position_embeddings of the "
                                              r"model's longrope"):
        _two_adapters(longrope, tiny_cache, max_seq_len=64)
    assert _two_adapters(longrope, tiny_cache, 32).limits.max_seq_len == 32


def test_on_a_longrope_model_another_tenants_datum_leaves_a_datums_logprobs_alone(
        longrope, tiny_cache):
    # A merged pass's positions restart per datum, and no datum passes 32 tokens, so
    # longrope keeps its short factors whatever the pass holds. Merged and alone run
    # GEMMs of other shapes: LOGPROB_ATOL.
    engine = _two_adapters(longrope, tiny_cache)
    short, other, long_ = random_datums(engine, (20, 30, 50))
    alone = engine.forward_batch([ForwardRequest("a", [short], CE, False)])[0].logprobs[0]
    merged = engine.forward_batch([ForwardRequest("a", [short], CE, False),
                                   ForwardRequest("b", [other], CE, False)])[0].logprobs[0]
    np.testing.assert_allclose(merged, alone, rtol=0, atol=LOGPROB_ATOL)
    # A datum that would switch the pass to the long factors (moving the 20-token
    # datum's logprobs by 0.08) is refused before it runs.
    with pytest.raises(InvalidArgument, match="50 tokens is over the 32-token limit"):
        engine.check_forward(ForwardRequest("b", [long_], CE, False))


def test_on_a_longrope_model_the_pools_logprobs_equal_the_trainers(longrope, tiny_cache):
    # Prefill and decode steps see their own lengths and other rows'; within 32 tokens
    # they all run the short factors, as the trainer's pass does. Other GEMM shapes:
    # LOGPROB_ATOL.
    engine = _two_adapters(longrope, tiny_cache)
    prompt, long_prompt = (d.input_ids for d in random_datums(engine, (10, 20)))
    request = SampleRequest("a", None, prompt, 2,
                            SamplingParams(max_tokens=22, seed=1, ignore_eos=True))
    # 20 + 30 positions: one row of that would switch its steps to the long factors.
    crossing = SampleRequest("a", None, long_prompt, 1,
                             SamplingParams(max_tokens=30, seed=1, ignore_eos=True))
    done = dict(engine.decode([request, crossing], [0, 1], 0.0))
    assert isinstance(done[1], InvalidArgument) and "32-token limit" in str(done[1])
    while 0 not in done:
        done.update(engine.decode([], [], 0.0))
    for sequence in done[0].sequences:
        assert sequence.tokens.size == 22
        forced = engine.compute_logprobs("a", None, np.concatenate(
            [prompt, sequence.tokens.astype(np.int64)]))[prompt.size:]
        np.testing.assert_allclose(sequence.logprobs, forced, rtol=0, atol=LOGPROB_ATOL)


@pytest.fixture(scope="module")
def dynamic(tiny_cache, tmp_path_factory):
    """A tiny Llama with dynamic NTK rope (factor 4) over a 32-token context, its
    attention logits scaled up so a change of frequencies shows."""
    return write_family(tmp_path_factory.mktemp("dynamic"), "llama", tiny_cache, qk_scale=4.0,
                        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                         "factor": 4.0},
                        max_position_embeddings=32)


def test_a_dynamic_rope_model_is_held_to_its_context_where_no_datum_moves_another(
        dynamic, tiny_cache):
    # transformers' dynamic NTK rope rescales its frequencies for a whole forward call
    # once a position in it passes max_position_embeddings (until a later, shorter call
    # resets them): past the context one sequence would change every other's numbers.
    engine = _two_adapters(dynamic, tiny_cache)
    assert engine.limits.max_seq_len == 32
    short, other = random_datums(engine, (20, 30))
    alone = engine.forward_batch([ForwardRequest("a", [short], CE, False)])[0].logprobs[0]
    merged = engine.forward_batch([ForwardRequest("a", [short], CE, False),
                                   ForwardRequest("b", [other], CE, False)])[0].logprobs[0]
    np.testing.assert_allclose(merged, alone, rtol=0, atol=LOGPROB_ATOL)
    [long_] = random_datums(engine, (50,), seed=1)
    with pytest.raises(InvalidArgument, match="50 tokens is over the 32-token limit"):
        engine.check_forward(ForwardRequest("b", [long_], CE, False))
    # What the limit keeps out: in the bare model, a 50-token row moves a 20-token row of
    # its batch (right-padded, so its own positions and attention are unchanged).
    model = transformers.AutoModelForCausalLM.from_pretrained(dynamic).eval()
    padded = np.concatenate([short.input_ids, np.zeros(30, np.int64)])
    batch = torch.as_tensor(np.stack([padded, long_.input_ids]))
    mask = torch.ones_like(batch)
    mask[0, 20:] = 0
    with torch.no_grad():
        alone_bare = model(torch.as_tensor(short.input_ids)[None]).logits[0]
        beside_long = model(batch, attention_mask=mask).logits[0, :20]
    # 0.025 measured (q and k scaled by 4, so attention is not near uniform): a hundred
    # times LOGPROB_ATOL, the most merged and alone may differ.
    assert (beside_long - alone_bare).abs().max() > 100 * LOGPROB_ATOL
