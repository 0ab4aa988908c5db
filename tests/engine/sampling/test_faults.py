"""Faults in the decode pool stay with their own request: a diverged adapter, running
out of memory in a prefill or a step, a device error. Every other request completes as if
alone, and the pool's accounting stays exact."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import EngineError, FailedPrecondition, ResourceExhausted
from twinkle_server.engine.types import EngineLimits, LoraSpec, SampleRequest, SamplingParams

from ..draws import assert_sampled_alike, sampled_alone
from ..faults import failing_forward

MARKER = 4001
"""A token id no other prompt here uses: a fault fires on forwards that feed it."""


def _request(adapter, prompt, n=1, max_tokens=8, seed=1, namespace="", **params):
    return SampleRequest(adapter, None, np.asarray(prompt, np.int64), n,
                         SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True,
                                        **params),
                         cache_namespace=namespace)


def _drain(engine, results, calls=200):
    for _ in range(calls):
        stats = engine.decode_stats()
        if not stats.active_rows and not stats.waiting_requests:
            return results
        results.update(engine.decode([], [], 0.0))
    raise AssertionError("the decode pool never drained")


def _alone(engine, request):
    """The request's sequences sampled by itself in the static batch, and what each draw
    saw (`draws.sampled_alone`)."""
    return sampled_alone(lambda: _ok(engine.sample_batch([request])[0]), request.params)


def _ok(out):
    assert not isinstance(out, Exception), out
    return out


def _same(alone, pooled):
    """The pooled request completed as if alone: its seeded draws are the same numbers on
    logits a rounding apart (another batch, the pool's padding), so tokens agree up to
    the first near tie that went the other way, logprobs within LOGPROB_ATOL up to there
    (`draws.assert_sampled_alike`). Bit for bit only in `--batch-invariant on`."""
    assert_sampled_alike(alone, _ok(pooled).sequences)


def _pool_is_empty(engine):
    stats = engine.decode_stats()
    assert (stats.active_rows, stats.waiting_requests) == (0, 0)


@pytest.fixture
def diverged(add, engine):
    """An adapter whose weights went to 1e30 (what one optim_step at lr=1e30 does): its
    logits are not finite."""
    add("diverged", LoraSpec(rank=4, alpha=8, seed=3))
    with torch.no_grad():
        for param in engine.adapters["diverged"].parameters():
            param.fill_(1e30)
    assert not np.isfinite(engine.compute_logprobs("diverged", None,
                                                   np.arange(1, 6))[1:]).all()
    return "diverged"


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_diverged_adapter_fails_its_own_request_and_every_other_row_goes_on(
        engine, add, diverged, temperature):
    add("healthy", LoraSpec(rank=4, alpha=8, seed=4))
    first = _request("healthy", [5, 6, 7], n=2, max_tokens=10, seed=1)
    base = _request(None, [8, 9], max_tokens=6, seed=2)
    bad = _request(diverged, [10, 11, 12], n=2, seed=3, temperature=temperature)
    results = dict(engine.decode([first], [0], 0.0))
    assert not results                     # mid-generation when the others join
    results.update(engine.decode([bad, base], [1, 2], 0.0))
    _drain(engine, results)
    error = results[1]
    assert isinstance(error, FailedPrecondition), error
    assert "not finite" in str(error) and "'diverged'" in str(error)
    _same(_alone(engine, first), results[0])
    _same(_alone(engine, base), results[2])
    _pool_is_empty(engine)
    later = dict(engine.decode([_request("healthy", [3, 4], seed=5)], [3], 0.0))
    assert not isinstance(_drain(engine, later)[3], Exception)


def test_the_static_batch_fails_a_diverged_adapter_alone(engine, add, diverged):
    add("healthy", LoraSpec(rank=4, alpha=8, seed=4))
    good = _request("healthy", [5, 6, 7], n=2, seed=1)
    out = engine.sample_batch([_request(diverged, [1, 2, 3], seed=2), good])
    assert isinstance(out[0], FailedPrecondition) and "not finite" in str(out[0])
    assert_sampled_alike(_alone(engine, good), _ok(out[1]))   # 3 rows against 2


def test_a_vanishing_temperature_decodes_greedily_beside_others_and_fails_no_one(engine):
    """A temperature of 2.5e-39 once overflowed the tempered scores to inf: the draw
    picked a token past the vocabulary, and the slice's error failed every request
    decoding with it (another tenant's included). Now it is the greedy limit."""
    other = _request(None, [5, 6, 7], n=2, max_tokens=10, seed=1)
    tiny = _request(None, [8, 9], max_tokens=6, seed=2, temperature=2.5e-39)
    results = dict(engine.decode([other], [0], 0.0))
    results.update(engine.decode([tiny], [1], 0.0))
    _drain(engine, results)
    _same(_alone(engine, other), results[0])
    greedy = _request(None, [8, 9], max_tokens=6, seed=2, temperature=0.0)
    _same(_alone(engine, greedy), results[1])
    _pool_is_empty(engine)


def test_out_of_memory_in_a_prefill_fails_only_the_request_that_caused_it(engine):
    decoding = _request(None, [5, 6, 7], n=2, max_tokens=10, seed=1)
    culprit = _request(None, [MARKER, 1, 2, 3], seed=2)
    beside = _request(None, [20, 21], n=3, seed=3)
    results = dict(engine.decode([decoding], [0], 0.0))
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with failing_forward(engine.base.model, oom, lambda ids: (ids == MARKER).any(),
                         times=10) as hits:
        results.update(engine.decode([culprit, beside], [1, 2], 0.0))
        _drain(engine, results)
    assert hits
    assert isinstance(results[1], ResourceExhausted) and "memory" in str(results[1])
    _same(_alone(engine, decoding), results[0])
    _same(_alone(engine, beside), results[2])
    _pool_is_empty(engine)


def test_out_of_memory_in_a_decode_step_fails_the_newest_request_and_the_rest_go_on(engine):
    older = _request(None, [5, 6, 7], n=2, max_tokens=12, seed=1)
    newer = _request(None, [30, 31, 32], max_tokens=12, seed=2)
    results = dict(engine.decode([older], [0], 0.0))
    results.update(engine.decode([newer], [1], 0.0))
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with failing_forward(engine.base.model, oom, lambda ids: ids.shape[1] == 1) as hits:
        results.update(engine.decode([], [], 0.0))
    assert hits
    _drain(engine, results)
    assert isinstance(results[1], ResourceExhausted) and "memory" in str(results[1])
    _same(_alone(engine, older), results[0])
    _pool_is_empty(engine)


def test_out_of_memory_giving_the_cache_new_columns_fails_the_newest_request_alone(
        engine, monkeypatch):
    """Before a step the pool may give every row's cache new spare columns (a copy of the
    whole cache): running out of memory there is the step's fault, as in its forward."""
    from twinkle_server.engine.sampling.cache_layers import BufferedLayer

    older = _request(None, [5, 6, 7], n=2, max_tokens=12, seed=1)
    newer = _request(None, [30, 31, 32], max_tokens=12, seed=2)
    results = dict(engine.decode([older], [0], 0.0))
    real, hits = BufferedLayer.hold, []

    def hold(self, keys, values, extra=0):
        if extra and not hits:
            hits.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, keys, values, extra)

    monkeypatch.setattr(BufferedLayer, "hold", hold)
    # The newer request joins bare (no spare columns): the next step reserves.
    results.update(engine.decode([newer], [1], 0.0))
    assert hits
    _drain(engine, results)
    assert isinstance(results[1], ResourceExhausted) and "memory" in str(results[1])
    _same(_alone(engine, older), results[0])
    _pool_is_empty(engine)


@contextlib.contextmanager
def _out_of_memory_in(monkeypatch, cls, name, times=10**6):
    """Inside the block, the first `times` calls of `cls.name` run out of memory; yields
    the list of failures so far."""
    real, hits = getattr(cls, name), []

    def failing(self, *args, **kwargs):
        if len(hits) < times:
            hits.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, failing)
    try:
        yield hits
    finally:
        monkeypatch.setattr(cls, name, real)


def test_a_prefill_allocates_nothing_after_its_join_so_no_row_joins_twice(engine,
                                                                           monkeypatch):
    """A joiner that stops at its first token never joins the batch: its row once joined
    and left at once, and out of memory as it left (copying its prefix entry, moving the
    rows that stay) was taken for a failed prefill, which joined every joiner again:
    4 rows for 2 samples, drawing from one generator, so their seeded tokens changed."""
    from twinkle_server.engine.sampling.kv_batch import KVBatch

    once = _request(None, [5, 6, 7], max_tokens=1, seed=4, namespace="once")
    group = _request(None, [8, 9, 10, 11], n=2, max_tokens=6, seed=5)
    with _out_of_memory_in(monkeypatch, KVBatch, "select"), \
            _out_of_memory_in(monkeypatch, KVBatch, "row_prefix"):
        results = dict(engine.decode([once, group], [0, 1], 0.0))
    assert engine.decode_stats().active_rows == 2
    _drain(engine, results)
    _same(_alone(engine, once), results[0])
    _same(_alone(engine, group), results[1])
    _pool_is_empty(engine)


def test_out_of_memory_as_rows_leave_fails_the_newest_request_still_decoding(engine,
                                                                              monkeypatch):
    """Moving the rows that stay after a step allocates: out of memory there fails the
    newest request still decoding, as in the step itself, and the rows leave again. The
    request that finished is answered and the older one goes on as alone (the fault once
    escaped the slice, which failed every request)."""
    from twinkle_server.engine.sampling.kv_batch import KVBatch

    older = _request(None, [5, 6, 7], n=2, max_tokens=12, seed=1)
    newer = _request(None, [30, 31, 32], n=2, max_tokens=12, seed=2)
    short = _request(None, [40, 41], max_tokens=2, seed=3, namespace="short")
    results = dict(engine.decode([older], [0], 0.0))
    results.update(engine.decode([newer], [1], 0.0))
    with _out_of_memory_in(monkeypatch, KVBatch, "select", times=1) as hits:
        results.update(engine.decode([short], [2], 0.0))    # its prefill, and one step
    assert hits
    assert isinstance(results[1], ResourceExhausted) and "memory" in str(results[1])
    _same(_alone(engine, short), results[2])
    _drain(engine, results)
    _same(_alone(engine, older), results[0])
    _pool_is_empty(engine)


def test_out_of_memory_copying_a_finished_rows_prefix_entry_keeps_no_entry_alone(
        engine, monkeypatch):
    """A finished row's prompt and completion are copied into the prefix cache: where
    memory cannot hold the copy, the cache keeps no entry for them (its prompt's, from
    the prefill, stays) and every request is served (the fault once escaped the slice,
    which failed every request)."""
    from twinkle_server.engine.sampling.kv_batch import KVBatch

    older = _request(None, [5, 6, 7], n=2, max_tokens=12, seed=1)
    prompt = [50, 51, 52]
    short = _request(None, prompt, max_tokens=2, seed=3, namespace="uncopied")
    results = dict(engine.decode([older], [0], 0.0))
    with _out_of_memory_in(monkeypatch, KVBatch, "row_prefix") as hits:
        results.update(engine.decode([short], [1], 0.0))    # its prefill, and one step
    assert hits
    _same(_alone(engine, short), results[1])
    _drain(engine, results)
    _same(_alone(engine, older), results[0])
    extended = prompt + results[1].sequences[0].tokens.tolist() + [9]
    later = _drain(engine, dict(engine.decode(
        [_request(None, extended, max_tokens=2, seed=4, namespace="uncopied")], [2], 0.0)))
    assert later[2].prompt_cache_hit_tokens == len(prompt)
    _pool_is_empty(engine)


def test_a_device_error_in_a_step_fails_that_steps_rows_as_values_and_empties_the_pool(
        engine):
    doomed = _request(None, [5, 6, 7], n=2, max_tokens=12, seed=1)
    results = dict(engine.decode([doomed], [0], 0.0))
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    with failing_forward(engine.base.model, error, lambda ids: ids.shape[1] == 1):
        results.update(engine.decode([], [], 0.0))
    assert isinstance(results[0], EngineError) and "illegal memory access" in str(results[0])
    _pool_is_empty(engine)
    after = _request(None, [9, 9, 9], max_tokens=5, seed=4)
    later = _drain(engine, dict(engine.decode([after], [1], 0.0)))
    _same(_alone(engine, after), later[1])


@pytest.fixture(scope="module")
def small_pool(tiny_cache):
    """An engine whose decode pool holds 1,000 KV positions."""
    return Engine.load("tiny", cache_dir=str(tiny_cache),
                       limits=EngineLimits(max_adapters=2, max_seq_len=512,
                                           max_batch_tokens=4096, kv_pool_tokens=1000))


def test_a_draw_that_fails_in_a_step_fails_that_steps_rows_and_not_the_waiting(
        small_pool, monkeypatch):
    """An error in a step's draw (after its forward) is the step's, as a forward's is:
    the step is undone and its rows fail; a request waiting for room is served after.
    (It once escaped the step and reset the whole pool, the waiting request too.)"""
    from twinkle_server.engine.sampling import tokens

    engine = small_pool
    doomed = _request(None, [5, 6, 7], n=2, max_tokens=12, seed=1)
    waiting = _request(None, list(range(100, 400)), n=2, max_tokens=200, seed=2)
    results = dict(engine.decode([doomed], [0], 0.0))
    results.update(engine.decode([waiting], [1], 0.0))
    assert engine.decode_stats().waiting_requests == 1      # 2 x 500 of 1,000: no room
    real = tokens.draw

    def failing(logits, segments, topk):
        if logits.shape[0] == 2:
            raise RuntimeError("the draw failed")
        return real(logits, segments, topk)

    monkeypatch.setattr(tokens, "draw", failing)
    results.update(engine.decode([], [], 0.0))
    monkeypatch.setattr(tokens, "draw", real)
    assert isinstance(results[0], EngineError) and "the draw failed" in str(results[0])
    _drain(engine, results)
    _same(_alone(engine, waiting), results[1])
    _pool_is_empty(engine)


def test_out_of_memory_in_a_steps_draw_leaves_the_others_drawing_as_alone(engine,
                                                                           monkeypatch):
    """The newest request fails; the older one's step is undone and run again, and its
    generator, which the failed draw had drawn from, is put back: its tokens stay the
    ones it draws alone (they once went on from numbers the failed draw had taken)."""
    from twinkle_server.engine.sampling import tokens

    older = _request(None, [5, 6, 7], n=2, max_tokens=10, seed=1)
    newer = _request(None, [8, 9], max_tokens=10, seed=2)
    results = dict(engine.decode([older], [0], 0.0))
    results.update(engine.decode([newer], [1], 0.0))
    real, failed = tokens.draw, []

    def failing(logits, segments, topk):
        if not failed and logits.shape[0] == 3:
            failed.append(1)
            for segment in segments:             # draws its numbers, then runs out
                tokens.uniforms(len(segment.rows), segment.generator, logits)
            raise torch.OutOfMemoryError("the draw ran out of memory")
        return real(logits, segments, topk)

    monkeypatch.setattr(tokens, "draw", failing)
    results.update(engine.decode([], [], 0.0))
    assert failed and isinstance(results.get(1), ResourceExhausted), results
    _drain(engine, results)
    _same(_alone(engine, older), results[0])
    _pool_is_empty(engine)


def test_the_prefix_cache_stays_within_the_kv_bound(small_pool):
    """Two session requests of 400 + 100 tokens fill a 1,000-position pool; their cached
    prompts and completions must not take it past the bound (once held 1,798)."""
    engine = small_pool
    requests = [_request(None, list(range(100 + i, 500 + i)), max_tokens=100, seed=i,
                         namespace=f"session-{i}") for i in range(2)]
    results = dict(engine.decode(requests, [0, 1], 0.0))
    bound = engine.limits.kv_pool_tokens
    for _ in range(300):
        stats = engine.decode_stats()
        assert stats.kv_in_use <= bound + stats.active_rows, stats
        if not stats.active_rows and not stats.waiting_requests:
            break
        results.update(engine.decode([], [], 0.0))
    assert sorted(results) == [0, 1]
    assert all(not isinstance(r, Exception) for r in results.values())
    stats = engine.decode_stats()
    assert stats.prefix_cache_tokens <= bound and stats.kv_in_use <= bound
