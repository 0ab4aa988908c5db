"""The sampler rank's publish gate on a real tiny engine, in one process: what a request
may start on, and when. (The channels between ranks are exercised by
`test_sampler_ranks.py` on 4 ranks; this file drives `SamplerRank.decode` directly, the
call its serving loop makes for each decode slice rank 0 sends.)"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from twinkle_server.engine import checkpoint
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import InvalidArgument, NotFound, Unavailable
from twinkle_server.engine.prompt_scoring import PromptScoring
from twinkle_server.engine.types import EngineLimits, LoraSpec, SampleRequest, SamplingParams
from twinkle_server.ranks.sampler_rank import PUBLISH, RELEASE, Link, Need, Publication, SamplerRank

from ..numerics import LOGPROB_ATOL

KEY = "run-1"
SPEC = LoraSpec(rank=4, alpha=8.0, seed=0)
PROMPT = np.asarray([5, 17, 29, 3, 88, 41], np.int64)


@pytest.fixture(scope="module")
def engine(tiny_cache) -> Engine:
    return Engine.load("tiny", cache_dir=str(tiny_cache),
                       limits=EngineLimits(max_adapters=4, max_seq_len=256,
                                           max_batch_tokens=4096, kv_pool_tokens=4096))


def _tensors(engine: Engine, seed: int) -> dict[str, torch.Tensor]:
    """LoRA tensors of SPEC's shape, both matrices random (so each version samples
    differently)."""
    engine.add_adapter("shape", SPEC)
    try:
        shapes = {k: v.shape for k, v in
                  checkpoint.peft_tensors(engine.adapters["shape"]).items()}
    finally:
        engine.remove_adapter("shape")
    generator = torch.Generator().manual_seed(seed)
    return {k: 0.3 * torch.randn(shape, generator=generator) for k, shape in shapes.items()}


def _request(key: str | None) -> SampleRequest:
    return SampleRequest(key, None, PROMPT, 1, SamplingParams(max_tokens=8, seed=7,
                                                              ignore_eos=True))


def _until_done(rank: SamplerRank, limit_s: float = 30.0) -> list:
    deadline = time.monotonic() + limit_s
    done: list = []
    while not done and time.monotonic() < deadline:
        done = rank.decode([], [], [], 0.05, [])
    return done


def _logprobs(engine: Engine, key: str, tokens: list[int]) -> np.ndarray:
    ids = np.concatenate([PROMPT, np.asarray(tokens, np.int64)])
    scored = engine.score_prompt(key, None, ids, PromptScoring(include=True))
    return scored.logprobs[-len(tokens):]


def test_a_request_for_an_unpublished_version_waits_and_never_runs_on_the_previous_one(
        engine):
    rank = SamplerRank(engine, Link(2, None, None), wait_s=30)
    first, second = _tensors(engine, 1), _tensors(engine, 2)
    rank.inbox.put((PUBLISH, Publication.of(KEY, 1, SPEC, first)))
    done = rank.decode([_request(KEY)], [1], [Need(KEY, 2)], 0.05, [])
    # Version 1 is live, the request waits for 2: it is held, not in the pool.
    assert done == [] and engine.sampling.versions[KEY] == 1
    assert not engine.sampling.pool.rows and not engine.sampling.pool.waiting
    assert len(rank.held) == 1
    rank.inbox.put((PUBLISH, Publication.of(KEY, 2, SPEC, second)))
    [(key, generation)] = _until_done(rank)
    assert key == 1 and engine.sampling.versions[KEY] == 2
    tokens = generation.sequences[0].tokens
    np.testing.assert_allclose(generation.sequences[0].logprobs,
                               _logprobs(engine, KEY, tokens), atol=LOGPROB_ATOL, rtol=0)
    # ...and version 1's weights would have given other logprobs for the same tokens.
    engine.sampling.install("v1", 1, SPEC, first)
    try:
        assert np.abs(_logprobs(engine, "v1", tokens)
                      - generation.sequences[0].logprobs).max() > 1e-3
    finally:
        engine.sampling.release("v1", Unavailable("test over"))
        engine.sampling.release(KEY, Unavailable("test over"))


def test_a_publication_the_engine_refuses_fails_the_requests_that_need_it(engine):
    rank = SamplerRank(engine, Link(2, None, None), wait_s=30)
    wrong = {k: v[:, :1] for k, v in _tensors(engine, 3).items()}
    rank.inbox.put((PUBLISH, Publication.of("bad", 1, SPEC, wrong)))
    [(key, error)] = rank.decode([_request("bad")], [5], [Need("bad", 1)], 0.05, [])
    assert key == 5 and isinstance(error, InvalidArgument)
    assert "bad" not in engine.sampling.versions


def test_weights_that_never_arrive_fail_the_request_unavailable_after_the_bound(engine):
    rank = SamplerRank(engine, Link(3, None, None), wait_s=0.2)
    answered = rank.decode([_request("never")], [9], [Need("never", 1)], 0.05, [])
    if not answered:   # still within the bound (a stalled call may already be past it)
        time.sleep(0.25)
        answered = rank.decode([], [], [], 0.05, [])
    [(key, error)] = answered
    assert key == 9 and isinstance(error, Unavailable)
    assert "sampler rank 3 waited 0.2 s for version 1 of 'never'" in str(error)


def test_a_request_on_the_base_needs_no_publication(engine):
    rank = SamplerRank(engine, Link(2, None, None), wait_s=30)
    [(key, generation)] = (rank.decode([_request(None)], [4], [Need(None, 0)], 0.05, [])
                           or _until_done(rank))
    assert key == 4 and len(generation.sequences[0].tokens) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_publication_carries_its_tensors_bit_for_bit_in_their_dtype(dtype):
    tensors = {"a": torch.randn(3, 5).to(dtype), "b": torch.randn(5, 2).to(dtype)}
    found = Publication.of("k", 4, SPEC, tensors)
    assert found.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    back = found.torch_tensors()
    for name, tensor in tensors.items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor)


def test_a_request_whose_weights_were_let_go_fails_with_why_at_once(engine):
    rank = SamplerRank(engine, Link(2, None, None), wait_s=30)
    rank.inbox.put((PUBLISH, Publication.of("gone", 1, SPEC, _tensors(engine, 4))))
    rank.inbox.put((RELEASE, "gone", NotFound("model_id: model 'gone' was unloaded")))
    [(key, error)] = rank.decode([_request("gone")], [6], [Need("gone", 1)], 0.05, [])
    assert key == 6 and isinstance(error, NotFound) and "unloaded" in str(error)
    # A later version of the key is a new publication: a request for it waits for it.
    assert rank.decode([_request("gone")], [7], [Need("gone", 2)], 0.05, []) == []
    rank.inbox.put((PUBLISH, Publication.of("gone", 2, SPEC, _tensors(engine, 5))))
    [(key, generation)] = _until_done(rank)
    assert key == 7 and len(generation.sequences[0].tokens) == 8
    engine.sampling.release("gone", Unavailable("test over"))
