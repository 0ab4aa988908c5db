"""Decode attention: reading a request's shared prompt once for all its samples gives each
row the attention it gets from its own whole cache; a model's attention logit soft cap
(Gemma 2) applies in decode steps as in the trainer's passes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from twinkle_server.engine.engine import Engine
from twinkle_server.engine.sampling.cache_layers import new_cache
from twinkle_server.engine.sampling.decode_attention import decode_attention, decoding
from twinkle_server.engine.sampling.kv_batch import KVBatch
from twinkle_server.engine.types import EngineLimits, LoraSpec, SampleRequest, SamplingParams

from ...numerics import LOGPROB_ATOL
from .. import small
from ..families import SOFT_CAPPED, random_datums, randomize_b, write_family

HEADS, KV_HEADS, DIM, PROMPT = 4, 2, 8, 6


def _batch(samples: list[int], padding: list[int], own: int) -> KVBatch:
    """Requests of `samples[i]` rows with a `PROMPT`-column prompt, left-padded by
    `padding[i]` (masked), then `own` columns each row wrote alone."""
    generator = torch.Generator().manual_seed(0)
    config = small.build().config
    layers = config.num_hidden_layers
    prompts = [[torch.randn(1, KV_HEADS, PROMPT, DIM, generator=generator) for _ in range(2)]
               for _ in range(layers)]
    index = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(samples))
    cache = new_cache(config, [(keys[[0] * len(samples)].clone(),
                                values[[0] * len(samples)].clone())
                               for keys, values in prompts])
    for layer in cache.layers:                 # each request its own prompt
        layer.keys.copy_(torch.randn(layer.keys.shape, generator=generator))
        layer.values.copy_(torch.randn(layer.values.shape, generator=generator))
        layer.hold(layer.keys[index], layer.values[index], extra=own)
    mask = torch.ones(len(samples), PROMPT, dtype=torch.long)
    for request, pad in enumerate(padding):
        mask[request, :pad] = 0
    batch = KVBatch(torch.device("cpu"))
    batch.join(cache, mask[index], torch.full((index.numel(),), PROMPT), index,
               groups=index.tolist())
    for _ in range(own):
        batch.step_inputs()
        for layer in batch.layers():
            new = torch.randn(batch.rows, KV_HEADS, 1, DIM, generator=generator)
            layer.update(new, new * 2)
    return batch


@pytest.mark.parametrize("padding", [[0, 0, 0], [0, 2, 1]])
def test_a_shared_prompt_read_once_gives_each_row_its_own_attention(padding):
    """Three requests of 2 samples, prompts padded or not: within 1e-6 of each row
    attending to its whole cache (float32 rounding of sums of 6..9 terms)."""
    batch = _batch([2, 2, 2], padding, own=3)
    shared = batch.shared_prefix(room=10**6)
    assert shared is not None and shared.width == PROMPT
    assert (shared.groups, shared.samples) == (3, 2)
    query = torch.randn(batch.rows, HEADS, 1, DIM)
    mask = batch.mask[:, None, None, :].bool()
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    for index, layer in enumerate(batch.layers()):
        module = SimpleNamespace(layer_idx=index)
        whole, _ = decode_attention(module, query, layer.keys, layer.values, mask)
        with decoding(model, shared):   # type: ignore[arg-type]
            once, _ = decode_attention(module, query, layer.keys, layer.values, mask)
        torch.testing.assert_close(once, whole, atol=1e-6, rtol=0)


def test_the_shared_columns_end_where_any_row_first_wrote_and_follow_joins_and_selects():
    """Shared while every request has as many rows (two or more), up to the first column
    a step wrote to any row; uneven or single rows read their own caches."""
    batch = _batch([2, 2], [0, 0], own=2)
    assert batch.shared_prefix(room=10**6).width == PROMPT
    late = _batch([2], [0], own=0)       # a request joins after 2 steps of the others
    batch.join(late.cache, late.mask, late.positions, late.pending, groups=[7, 7])
    assert batch.group[4] == batch.group[5] != batch.group[0]
    assert batch.shared_prefix(room=10**6).width == PROMPT and batch.width == PROMPT + 2
    batch.select([0, 1, 2, 4, 5])        # one request's sample stops: uneven
    assert batch.shared_prefix(room=10**6) is None
    batch.select([0, 2, 3])              # one row each
    assert batch.shared_prefix(room=10**6) is None
    assert _batch([3, 1], [0, 0], own=1).shared_prefix(room=10**6) is None


def test_the_shared_copy_counts_in_what_the_batch_holds_and_is_made_only_within_its_room():
    """Two requests of 3 samples: the copy is 2 groups x PROMPT columns, held beside the
    rows' own; with less room than that the rows read their own caches."""
    tight = _batch([3, 3], [0, 0], own=1)
    own = tight.held()
    assert tight.shared_prefix(room=2 * PROMPT - 1) is None and tight.held() == own
    batch = _batch([3, 3], [0, 0], own=1)
    assert batch.shared_prefix(room=2 * PROMPT).width == PROMPT
    assert batch.held() == own + 2 * PROMPT
    batch.select([0, 1, 2, 3, 4])           # uneven: the copy is dropped
    assert batch.shared_prefix(room=10**6) is None and batch.held() == 5 * own // 6


def test_a_soft_capped_gemma2s_pool_logprobs_equal_the_trainers(tiny_cache, tmp_path):
    # Gemma 2 passes its cap (`softcap`) to its eager attention, which decode steps
    # replace (`decode_attention`). Two samples of a 10-token prompt (their prompt read
    # once), 20 tokens each: past the 16-token window of its sliding layers.
    path = write_family(tmp_path, "gemma2", tiny_cache, **SOFT_CAPPED)
    engine = Engine.load(str(path), cache_dir=str(tiny_cache),
                         limits=EngineLimits(max_adapters=2, max_rank=16, max_seq_len=64,
                                             max_batch_tokens=1024, kv_pool_tokens=256))
    engine.add_adapter("a", LoraSpec.from_tinker(8, seed=1))
    randomize_b(engine, "a", 3, 0.05)
    prompt = random_datums(engine, (10,))[0].input_ids
    request = SampleRequest("a", None, prompt, 2,
                            SamplingParams(max_tokens=20, seed=1, ignore_eos=True))
    done = dict(engine.decode([request], [0], 0.0))
    while 0 not in done:
        done.update(engine.decode([], [], 0.0))
    for sequence in done[0].sequences:
        assert sequence.tokens.size == 20
        # The trainer's teacher-forced pass over prompt + sample (`compute_logprobs`):
        # other GEMM shapes, the same numbers to LOGPROB_ATOL.
        forced = engine.compute_logprobs("a", None, np.concatenate(
            [prompt, sequence.tokens.astype(np.int64)]))[prompt.size:]
        np.testing.assert_allclose(sequence.logprobs, forced, rtol=0, atol=LOGPROB_ATOL)
