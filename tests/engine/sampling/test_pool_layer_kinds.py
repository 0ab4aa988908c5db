"""The decode pool on every layer kind (issue 45). Hybrids: Gated DeltaNet linear
attention (Qwen3.5, Qwen3-Next), Mamba2 (Nemotron-H) and a short convolution (LFM2) hold a
state of fixed size per row beside the attention layers' keys and values
(`cache_layers.StateLayer`). Sliding windows (Mistral, Gemma 3, gpt-oss with its attention
sinks) keep the batch's last W - 1 columns and a decode step's mask keeps each row's
window (`decode_attention`); the window here is 4 positions, so that every request
outgrows it.

Rows join mid-generation, leave when they stop, and are undone with a failed step with
their states; seeded requests get what the static batch gives each alone, up to the
first near tie (`draws.assert_sampled_alike`: another batch rounds the logits
differently); admission counts each row's states; a session's cached prefix is reused
whole, from the states or the window's positions kept at its end.
Random tiny models from the families' transformers config classes.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from twinkle_server.engine.errors import Cancelled, EngineError, ResourceExhausted
from twinkle_server.engine.parallel import OneRank
from twinkle_server.engine.sampling.cache_layers import (
    sliding_layers,
    state_layers,
    unsupported_layers,
)
from twinkle_server.engine.sampling.pool import DecodePool
from twinkle_server.engine.sampling.static import generate
from twinkle_server.engine.types import SampleRequest, SamplingParams

from .. import small
from ..draws import assert_sampled_alike, sampled_alone
from ..families import family_config, skip_unchecked_mixers
from ..faults import failing_forward
from .test_pool import _drain

HYBRIDS = ["qwen3_5_text", "qwen3_next", "nemotron_h", "lfm2"]
WINDOWED = ["mistral", "gemma3_text", "gpt_oss"]
WINDOW = 4


@functools.cache
def _build(family: str) -> torch.nn.Module:
    skip_unchecked_mixers(family)
    window = {"sliding_window": WINDOW} if family in WINDOWED else {}
    config = family_config(family, small.EOS + 1, pad_token_id=0, **window)
    if unsupported_layers(config):
        pytest.skip(f"this transformers keeps {family}'s states in a cache of the model's "
                    "own: the pool refuses it")
    assert state_layers(config) if family in HYBRIDS else sliding_layers(config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module", params=HYBRIDS + WINDOWED)
def layered(request) -> torch.nn.Module:
    """A model of each layer kind the pool holds besides full attention."""
    return _build(request.param)


def _pool(model, capacity=100_000, fault=None) -> DecodePool:
    kwargs = {} if fault is None else {"fault": fault}
    return DecodePool(model, small.route, eos_token_ids=(small.EOS,), pad_token_id=0,
                      decode=small.decode, capacity=capacity, prefill_tokens=10_000,
                      parallel=OneRank(), **kwargs)


def _req(prompt, n=1, **params) -> SampleRequest:
    return SampleRequest(None, None, np.asarray(prompt, np.int64), n,
                         SamplingParams(**{"max_tokens": 16, **params}))


def _alone(model, request):
    return sampled_alone(lambda: generate(
        model, small.route, [request], [None], eos_token_ids=(small.EOS,), pad_token_id=0,
        decode=small.decode)[0], request.params)


def test_rows_joining_mid_generation_and_leaving_get_what_the_static_batch_gives(layered):
    first = _req([5, 6, 7, 8], 2, max_tokens=12, seed=42)
    late = [_req([1, 2], 1, max_tokens=5, seed=1),
            _req(list(range(10, 20)), 3, max_tokens=7, seed=2, top_k=20, top_p=0.9)]
    pool = _pool(layered)
    pool.submit("first", first, None)
    results = dict(pool.run(0.0))
    assert pool.rows and "first" not in results      # mid-generation when the others join
    for i, request in enumerate(late):
        pool.submit(i, request, None)
    _drain(pool, results)
    for key, request in [("first", first), *enumerate(late)]:
        assert_sampled_alike(_alone(layered, request), results[key].sequences, str(key))


def test_groups_of_samples_read_their_prompt_once_and_keep_their_own_states(layered):
    """Two RL groups of four: the pool holds each group's prompt columns once
    (`KVBatch.shared_prefix`) while every row keeps its own recurrent state. The prompts
    outgrow the window, whose layers then read their own columns: a model all of
    windows (Mistral) holds no copy."""
    groups = [_req([5, 6, 7, 8, 9], 4, max_tokens=8, seed=3),
              _req([40, 41, 42], 4, max_tokens=8, seed=4)]
    pool = _pool(layered)
    for i, request in enumerate(groups):
        pool.submit(i, request, None)
    results = dict(pool.run(0.0))
    windows_only = len(sliding_layers(layered.config)) == layered.config.num_hidden_layers
    assert (pool.batch.shared is None) == windows_only
    _drain(pool, results)
    for i, request in enumerate(groups):
        assert_sampled_alike(_alone(layered, request), results[i].sequences)


def test_a_step_that_fails_after_the_mixers_ran_is_undone_states_and_all(layered):
    """Out of memory at the output layer, after every mixer updated its state (a conv
    state in place): the step is undone, the newest request fails, and the older one
    goes on from the states before the step, as if alone."""
    older = _req([5, 6, 7], 2, max_tokens=12, seed=1)
    newer = _req([30, 31, 32], 1, max_tokens=12, seed=2)
    pool = _pool(layered, fault=lambda exc, what: ResourceExhausted(f"{what}: {exc}"))
    pool.submit(0, older, None)
    results = dict(pool.run(0.0))
    pool.submit(1, newer, None)
    results.update(pool.run(0.0))
    hits: list[int] = []

    def out_of_memory(module, args):
        if not hits:
            hits.append(1)
            raise torch.OutOfMemoryError("out of memory at the output layer")

    handle = layered.get_output_embeddings().register_forward_pre_hook(out_of_memory)
    try:
        results.update(pool.run(0.0))
    finally:
        handle.remove()
    assert hits
    _drain(pool, results)
    assert isinstance(results[1], ResourceExhausted), results[1]
    assert_sampled_alike(_alone(layered, older), results[0].sequences)


def test_joiners_of_prefixes_of_other_lengths_and_none_join_in_one_slice_as_alone(layered):
    """Three sessions' next turns, cached prefixes of 25, 23 and 2 tokens (the last shorter
    than a window), with as many new tokens each and two samples, beside two requests
    without a session: the prefixes sit right-aligned before their new tokens, padding
    before them, and every request samples what it gives alone."""
    pool = _pool(layered)
    starts = {"a": (list(range(10, 30)), 6), "b": (list(range(40, 58)), 6), "c": ([90], 2)}
    turns = {}
    for name, (start, replied) in starts.items():
        pool.submit(name, _req(start, 1, max_tokens=replied, seed=1, ignore_eos=True), None,
                    (name, "v1"))
        reply = [int(t) for t in _drain(pool, {})[name].sequences[0].tokens]
        turns[name] = (start + reply + [7, 8, 9], len(start) + len(reply) - 1)
    assert [cached for _, cached in turns.values()] == [25, 23, 2]
    requests = {name: _req(prompt, 2, max_tokens=5, seed=2) for name, (prompt, _) in
                turns.items()}
    requests |= {"x": _req(list(range(100, 103)), 1, max_tokens=5, seed=3),
                 "y": _req(list(range(110, 114)), 2, max_tokens=5, seed=4)}
    for name, request in requests.items():
        pool.submit(name, request, None, (name, "v1") if name in turns else None)
    results = _drain(pool, {})
    for name, request in requests.items():
        cached = turns[name][1] if name in turns else 0
        assert results[name].prompt_cache_hit_tokens == cached, name
        assert_sampled_alike(_alone(layered, request), results[name].sequences, name)


@pytest.mark.parametrize("family", HYBRIDS)
def test_admission_counts_each_rows_recurrent_states(family):
    layered = _build(family)
    request = _req([5, 6, 7, 8], 2, max_tokens=6, seed=5)
    per_row = request.prompt.size + request.params.max_tokens
    row_state = _pool(layered).cost.state
    assert row_state > 0
    need = request.num_samples * (per_row + row_state)
    pool = _pool(layered, capacity=need - 1)
    pool.submit(0, request, None)
    refused = dict(pool.run(0.0))
    assert isinstance(refused[0], ResourceExhausted)
    assert "recurrent layers' state" in str(refused[0]) and f"= {need} KV" in str(refused[0])
    pool = _pool(layered, capacity=need)
    pool.submit(0, request, None)
    served = _drain(pool, {})
    assert_sampled_alike(_alone(layered, request), served[0].sequences)
    assert pool.stats().kv_in_use == 0


SESSION = ("session", "v1")


def _turn(pool, model) -> tuple[list[int], int]:
    """A conversation's first turn in `pool`; its second turn's prompt (the first's prompt
    and completion, and two new tokens) and how many of its tokens the first cached."""
    first = list(range(10, 30))
    pool.submit("first", _req(first, 1, max_tokens=5, seed=3), None, SESSION)
    reply = [int(t) for t in _drain(pool, {})["first"].sequences[0].tokens]
    return first + reply + [7, 8], len(first) + len(reply) - 1


def test_the_next_turn_goes_on_from_what_the_cache_kept_at_its_prefixs_end(layered):
    """The second turn computes only its new tokens, from the recurrent states kept with
    the first turn's prompt and completion or a window's last positions, and samples
    what computing its whole prompt alone gives; twice: the entry is as it was after a
    turn decoded from it."""
    pool = _pool(layered)
    turn, cached = _turn(pool, layered)
    for key in range(2):
        request = _req(turn, 1, max_tokens=6, seed=4 + key)
        pool.submit(key, request, None, SESSION)
        reused = _drain(pool, {})[key]
        assert reused.prompt_cache_hit_tokens == cached
        assert_sampled_alike(_alone(layered, request), reused.sequences, str(key))


def test_no_prefix_is_reused_that_ends_before_a_cached_entrys_end(layered):
    """A state, or a window's last positions, hold at its entry's end alone: a repeated
    prompt, or one that departs from a cached entry within it, computes every token and
    draws as a fresh one."""
    pool = _pool(layered)
    _turn(pool, layered)
    for key, prompt in enumerate((list(range(10, 30)), list(range(10, 20)) + [1, 2, 3])):
        request = _req(prompt, 2, max_tokens=6, seed=9)
        pool.submit(key, request, None, SESSION)
        result = _drain(pool, {})[key]
        assert result.prompt_cache_hit_tokens == 0
        assert_sampled_alike(_alone(layered, request), result.sequences, str(key))
    assert pool.stats().prefix_hit_tokens == 0


def test_a_joiner_with_a_cached_prefix_prefills_with_no_padding_after_it(layered):
    """Joining in one slice beside a longer prompt, which would pad the short second
    turn between its prefix and its new tokens, it is prefilled apart and both sample
    what each gives alone."""
    pool = _pool(layered)
    turn, cached = _turn(pool, layered)
    requests = {"turn": _req(turn, 1, max_tokens=6, seed=5),
                "long": _req(list(range(40, 64)), 3, max_tokens=6, seed=6)}
    for key, request in requests.items():
        pool.submit(key, request, None, SESSION)
    results = _drain(pool, {})
    assert results["turn"].prompt_cache_hit_tokens == cached
    for key, request in requests.items():
        assert_sampled_alike(_alone(layered, request), results[key].sequences, key)
    stats = pool.stats()
    assert stats.prompt_tokens_computed == 20 + len(turn) - cached + 24


def _fault(exc: BaseException, what: str):
    """The engine's mapping, as far as these tests need it: out of memory is the
    request's own; any other error stays with the requests of the forward."""
    if isinstance(exc, torch.OutOfMemoryError):
        return ResourceExhausted(f"{what}: out of memory")
    return EngineError(f"sampling: {what} failed: {exc}")


def test_out_of_memory_in_a_joiners_prefill_fails_that_joiner_alone(layered):
    marker = 250
    decoding = _req([5, 6, 7], 2, max_tokens=10, seed=1)
    culprit = _req([marker, 1, 2, 3], seed=2)
    beside = _req([20, 21], 3, seed=3)
    pool = _pool(layered, fault=_fault)
    pool.submit(0, decoding, None)
    results = dict(pool.run(0.0))
    pool.submit(1, culprit, None)
    pool.submit(2, beside, None)
    oom = torch.OutOfMemoryError("out of memory")
    with failing_forward(layered, oom, lambda ids: (ids == marker).any(), times=10) as hits:
        _drain(pool, results)
    assert hits and isinstance(results[1], ResourceExhausted)
    assert_sampled_alike(_alone(layered, decoding), results[0].sequences)
    assert_sampled_alike(_alone(layered, beside), results[2].sequences)


def test_a_device_error_in_a_step_fails_its_rows_and_leaves_the_pool_clean(layered):
    pool = _pool(layered, fault=_fault)
    pool.submit(0, _req([5, 6, 7], 2, max_tokens=10, seed=1), None)
    results = dict(pool.run(0.0))
    error = RuntimeError("device error")
    with failing_forward(layered, error, lambda ids: ids.shape[1] == 1) as hits:
        results.update(pool.run(0.0))
    assert hits and type(results[0]) is EngineError and "device error" in str(results[0])
    assert not pool.rows and not pool.batch.layers()
    later = _req([8, 9], 2, max_tokens=6, seed=4)
    pool.submit(1, later, None)
    assert_sampled_alike(_alone(layered, later), _drain(pool, {})[1].sequences)


def test_a_cancelled_request_leaves_and_the_others_states_stay_their_own(layered):
    kept = _req([5, 6, 7], 2, max_tokens=10, seed=1)
    pool = _pool(layered)
    pool.submit("gone", _req([30, 31], 3, max_tokens=10, seed=2), None)
    pool.submit("kept", kept, None)
    results = dict(pool.run(0.0))
    pool.cancel(["gone"])
    _drain(pool, results)
    assert isinstance(results["gone"], Cancelled)
    assert_sampled_alike(_alone(layered, kept), results["kept"].sequences)


@pytest.mark.parametrize("family", WINDOWED)
def test_a_windows_layers_hold_only_its_window_however_long_the_rows_grow(family):
    """40 tokens past a 4-position window: each window layer keeps the batch's last 3
    columns (the step's new one completes the window) whenever it gets new buffers, so
    its buffers hold at most those and the spare columns, while a full layer holds every
    column; the draws are the static batch's, and the pool counts what it holds."""
    from twinkle_server.engine.sampling.pool import SPARE_COLUMNS

    layered = _build(family)
    request = _req([5, 6, 7, 8, 9], 1, max_tokens=40, seed=11, ignore_eos=True)
    pool = _pool(layered)
    pool.submit(0, request, None)
    results = dict(pool.run(0.0))
    while pool.batch.width < 30:
        results.update(pool.run(0.0))
    layers = pool.batch.kv_layers()
    windows = [layer for layer in layers if layer.window is not None]
    assert windows and {layer.window for layer in windows} == {WINDOW}
    for layer in windows:
        assert layer.offset > 0
        assert layer.offset + layer.keys.shape[-2] == pool.batch.width
        assert layer.keys.shape[-2] <= layer.columns() <= WINDOW - 1 + SPARE_COLUMNS
    full = [layer for layer in layers if layer.window is None]
    assert all(layer.keys.shape[-2] == pool.batch.width for layer in full)
    rows = pool.batch.rows
    # Held, in positions of every layer: a full layer's columns count whole, a window's
    # its own; without windows every layer would hold a full layer's columns.
    assert pool.batch.held() <= rows * (WINDOW - 1 + SPARE_COLUMNS if not full
                                        else full[0].columns())
    if full:
        assert pool.batch.held() < rows * full[0].columns()
    _drain(pool, results)
    assert_sampled_alike(_alone(layered, request), results[0].sequences)


@pytest.mark.parametrize("family", WINDOWED)
def test_admission_counts_a_windows_layers_at_the_columns_they_keep(family):
    """A request whose rows outgrow the window many times: the pool needs the full
    layers' every column and the windows' kept ones (`RowCost`), fewer than every
    column of every layer, and takes it at exactly that capacity, not one below."""
    layered = _build(family)
    request = _req([5, 6, 7, 8], 2, max_tokens=120, seed=9, ignore_eos=True)
    cost = _pool(layered).cost
    assert cost.windowed and cost.window < request.prompt.size + 120
    need = request.num_samples * cost.positions(request.prompt.size + 120)
    assert need < request.num_samples * (request.prompt.size + 120)
    pool = _pool(layered, capacity=need - 1)
    pool.submit(0, request, None)
    refused = dict(pool.run(0.0))[0]
    assert isinstance(refused, ResourceExhausted) and f"= {need} KV positions" in str(refused)
    assert f"{cost.windowed} of {cost.layers} attention layers" in str(refused)
    pool = _pool(layered, capacity=need)
    pool.submit(0, request, None)
    served = {}
    while 0 not in served:
        served.update(pool.run(0.0))
        assert pool.batch.held() <= need + pool.batch.rows     # one column a row, at most
    assert_sampled_alike(_alone(layered, request), served[0].sequences)
