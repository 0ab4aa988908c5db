"""`--batch-invariant on`: a seeded request's tokens and logprobs are the same bit for bit
alone, beside other tenants' requests of other lengths, at any decode slice, with a
prefix-cache hit or not, in the decode pool and the static batch, and in a new engine.

These are exact comparisons on purpose: the mode computes every row by products of one
shape and sums in an order set by the row's own positions (`engine.batch_invariant`), so
equality is what it promises on any CPU, not a rounding that happens to agree here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from twinkle_server.engine import batch_invariant
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import EngineLimits, LoraSpec, SampleRequest, SamplingParams

from ..numerics import LOGPROB_ATOL

LIMITS = EngineLimits(max_adapters=4, max_rank=16, max_seq_len=256, max_batch_tokens=8192,
                      kv_pool_tokens=20_000)
PROMPT = [17, 3, 250, 41, 9, 77, 1200, 64, 8, 501, 33, 2047, 12]


def _load(tiny_cache, invariant: bool) -> Engine:
    engine = Engine.load("tiny", cache_dir=str(tiny_cache), limits=LIMITS,
                         batch_invariant=invariant)
    for name, seed in (("mine", 1), ("theirs", 2)):
        engine.add_adapter(name, LoraSpec(rank=8, alpha=16, seed=seed))
        generator = torch.Generator().manual_seed(seed)
        for param in engine.adapters[name].parameters():   # B starts at zero
            param.data.normal_(0, 0.05, generator=generator)
    return engine


@pytest.fixture(scope="module")
def invariant(tiny_cache) -> Engine:
    return _load(tiny_cache, True)


def _mine(namespace: str = "", num_samples: int = 2, adapter: str | None = "mine"
          ) -> SampleRequest:
    return SampleRequest(adapter, None, np.asarray(PROMPT, np.int64), num_samples,
                         SamplingParams(max_tokens=24, seed=1234, temperature=1.0,
                                        ignore_eos=True), topk_logprobs=3,
                         cache_namespace=namespace)


def _theirs() -> list[SampleRequest]:
    """Other tenants' requests: other adapters, prompt lengths, sample counts, seeds."""
    rng = np.random.default_rng(7)
    return [SampleRequest(adapter, None, rng.integers(0, 4000, size=length), n,
                          SamplingParams(max_tokens=tokens, seed=seed, ignore_eos=True))
            for adapter, length, n, tokens, seed in (
                ("theirs", 5, 1, 30, 1), (None, 90, 3, 12, 2), ("theirs", 31, 4, 36, 3),
                ("mine", 2, 1, 9, 4))]


def _decode(engine: Engine, first: list[SampleRequest], later: list[SampleRequest],
            slice_s: float) -> dict:
    """`first` join, one slice runs, then `later` join; slices of `slice_s` to the end."""
    results = dict(engine.decode(first, list(range(len(first))), slice_s))
    results.update(engine.decode(later, list(range(len(first), len(first) + len(later))),
                                 slice_s))
    for _ in range(500):
        if len(results) == len(first) + len(later):
            return results
        results.update(engine.decode([], [], slice_s))
    raise AssertionError("the pool never drained")


def _exact(a, b) -> None:
    """Two sample results equal bit for bit: tokens, logprobs, top-k, stop reasons."""
    a = a.sequences if hasattr(a, "sequences") else a
    b = b.sequences if hasattr(b, "sequences") else b
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.tokens.tolist() == y.tokens.tolist()
        assert x.logprobs.tobytes() == y.logprobs.tobytes()
        for field in ("topk_token_ids", "topk_logprobs"):
            mine, theirs = getattr(x, field), getattr(y, field)
            assert (mine is None) == (theirs is None)
            assert mine is None or mine.tobytes() == theirs.tobytes()
        assert x.stop_reason == y.stop_reason


def test_a_rows_product_is_the_same_at_any_position_and_in_any_number_of_rows():
    """The premise of the mode's products, checked on this machine for the tiny model's
    shapes: a row's result does not depend on its position among the batch's rows, on
    the other rows, or on how many there are (1, a tile, a tile and one, many)."""
    generator = torch.Generator().manual_seed(0)
    tile = batch_invariant.ROW_TILE
    for inner, outer in ((128, 128), (128, 384), (384, 128), (128, 4096), (128, 8)):
        weight = torch.randn(outer, inner, generator=generator)
        row = torch.randn(inner, generator=generator)
        seen = set()
        for count, position in ((1, 0), (tile, 3), (tile + 1, tile), (300, 0), (300, 157)):
            rows = torch.randn(count, inner, generator=generator)
            rows[position] = row
            with batch_invariant._Invariant():
                seen.add(F.linear(rows, weight)[position].numpy().tobytes())
        assert len(seen) == 1, (inner, outer)


def test_a_seeded_request_is_the_same_alone_and_beside_other_tenants_at_any_slice(invariant):
    alone = _decode(invariant, [_mine()], [], 0.0)[0]
    for slice_s, mine_first in ((0.0, True), (0.0, False), (10.0, True)):
        theirs = _theirs()
        first, later = ([_mine()], theirs) if mine_first else (theirs[:2], [_mine()] + theirs[2:])
        results = _decode(invariant, first, later, slice_s)
        _exact(alone, results[0 if mine_first else 2])


def test_a_seeded_request_is_the_same_in_the_static_batch_alone_or_not(invariant):
    alone = invariant.sample_batch([_mine()])[0]
    _exact(alone, invariant.sample_batch(_theirs()[:2] + [_mine()] + _theirs()[2:])[2])
    _exact(alone, _decode(invariant, [_mine()], [], 0.0)[0])


def test_a_prefix_cache_hit_gives_what_computing_the_prompt_gave(invariant):
    # The base: a live adapter's weights change with every step, so its prompts are never
    # cached (a sampler checkpoint's or the base's are).
    first = _decode(invariant, [_mine("session-1", 1, None)], [], 0.0)[0]
    again = _decode(invariant, [_mine("session-1", 1, None)], _theirs(), 0.0)[0]
    assert first.prompt_cache_hit_tokens == 0 and again.prompt_cache_hit_tokens > 0
    _exact(first, again)
    # A prompt that extends the first sample's prompt and completion reuses their KV,
    # which decode steps computed: it samples as a fresh session computing it all.
    tokens = PROMPT + first.sequences[0].tokens[:16].tolist()
    extended = SampleRequest(None, None, np.asarray(tokens, np.int64), 1,
                             SamplingParams(max_tokens=10, seed=5, ignore_eos=True),
                             cache_namespace="session-1")
    hit = _decode(invariant, [extended], _theirs()[:1], 0.0)[0]
    assert hit.prompt_cache_hit_tokens > len(PROMPT)
    cold = invariant.sample_batch([extended])[0]
    _exact(hit, cold)


def test_a_new_engine_gives_the_same_tokens(invariant, tiny_cache):
    before = _decode(invariant, [_mine()], _theirs(), 0.0)[0]
    restarted = _load(tiny_cache, True)
    _exact(before, _decode(restarted, [_mine()], [], 0.0)[0])


def test_without_the_mode_company_may_change_the_last_bits(tiny_cache):
    """What `--batch-invariant off` promises instead: the same request beside others
    gives the same tokens up to where a draw falls within rounding of a boundary, and
    logprobs within LOGPROB_ATOL up to there (float32 rounding of the pass:
    tests/numerics.py); bits may differ. Whether they do depends on this CPU's kernels,
    so that is printed, not asserted."""
    engine = _load(tiny_cache, False)
    alone = _decode(engine, [_mine()], [], 0.0)[0].sequences
    beside = _decode(engine, [_mine()], _theirs(), 0.0)[0].sequences
    worst = 0.0
    for a, b in zip(alone, beside, strict=True):
        parted = np.flatnonzero(a.tokens != b.tokens)
        n = int(parted[0]) if parted.size else a.tokens.size
        worst = max(worst, float(np.abs(a.logprobs[:n] - b.logprobs[:n]).max(initial=0.0)))
    print(f"--batch-invariant off: alone vs beside others, largest logprob difference "
          f"before the tokens part: {worst:.3g}")
    assert worst <= LOGPROB_ATOL


def test_a_model_with_sliding_window_layers_is_refused_by_name(tiny_cache):
    """The mode computes full causal attention; a windowed layer would read past its
    window, so such a model is refused when its engine is made."""
    from pathlib import Path

    from twinkle_server.engine.base_model import BaseModel

    from . import small

    tokenizer = Engine.load("tiny", cache_dir=str(tiny_cache)).base.tokenizer
    windowed = small.build(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    base = BaseModel(model=windowed.requires_grad_(False), tokenizer=tokenizer,
                     name="windowed", model_dir=Path("."), device=torch.device("cpu"),
                     dtype=torch.float32)
    with pytest.raises(InvalidArgument, match="--batch-invariant on.*DynamicSlidingWindowLayer"):
        Engine(base, LIMITS, batch_invariant=True)


def test_the_pool_keeps_no_room_for_shared_prompt_copies_the_mode_never_makes(model):
    """Groups of 4 samples of 20-token prompts (10 tokens each) take 4 x 30 positions
    each: in 380, three decode at once when no room is kept for copies of their prompts,
    which the mode's steps never make (each row reads its own cache)."""
    from twinkle_server.engine.parallel import OneRank
    from twinkle_server.engine.sampling.pool import DecodePool

    from . import small

    pool = DecodePool(model, small.route, eos_token_ids=(small.EOS,), pad_token_id=0,
                      decode=small.decode, capacity=380, prefill_tokens=10_000,
                      parallel=OneRank(), batch_invariant=True)
    for i in range(6):
        pool.submit(i, SampleRequest(None, None, np.arange(20 + i, 40 + i), 4,
                                     SamplingParams(max_tokens=10, seed=i, ignore_eos=True)),
                    None)
    results, rows = {}, []
    while len(results) < 6:
        results.update(pool.run(0.0))
        stats = pool.stats()
        assert stats.kv_in_use <= 380 + stats.active_rows, stats
        assert pool.batch.shared is None
        rows.append(stats.active_rows)
    assert max(rows) == 12, rows
