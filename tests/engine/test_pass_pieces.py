"""A pass larger than `EngineLimits.max_pass_tokens` runs through the base in pieces
(`engine.forward.PassLogprobs`): values first, then each piece again with grad. Every
loss, logprob and gradient equals the one-piece pass's.

Tolerances (tests/numerics.py): the pieces run GEMMs of other shapes than the whole pass,
so they agree to the isolation contract's float32 bounds, not bit for bit.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from twinkle_server.engine.engine import ForwardRequest
from twinkle_server.engine.errors import ResourceExhausted
from twinkle_server.engine.forward import pieces
from twinkle_server.engine.types import Datum, LoraSpec, LossSpec

from ..numerics import LOGPROB_ATOL, LOSS_RTOL, assert_grads_close
from .faults import failing_replay

SPEC = LoraSpec(rank=4, alpha=8, target_modules="all-linear", seed=3)
CAP = 24
"""Tokens per piece here: the fixture's datums (10-16 tokens) make passes of 3-6 pieces."""


def test_pieces_are_consecutive_runs_within_the_cap():
    assert pieces([10, 10, 5, 30, 1], 20) == [range(0, 2), range(2, 3), range(3, 4),
                                             range(4, 5)]
    assert pieces([3, 4], 0) == [range(0, 2)]
    assert pieces([], 8) == []


def _rl(datums: list[Datum], seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for d in datums:
        n = d.num_tokens
        out.append(Datum(d.input_ids, {**d.loss_inputs,
                                       "logprobs": rng.normal(-3, 0.5, n).astype(np.float32),
                                       "advantages": rng.normal(0, 1, n).astype(np.float32)}))
    return out


def _run(engine, name: str, requests: list[ForwardRequest], cap: int):
    saved = engine.limits
    engine.limits = replace(saved, max_pass_tokens=cap)
    try:
        outs = engine.forward_batch([replace(r, adapter_id=f"{r.adapter_id}-{name}")
                                     for r in requests])
    finally:
        engine.limits = saved
    grads = {a: np.concatenate([p.grad.numpy().ravel() for p in
                                engine.adapters[f"{a}-{name}"].parameters()])
             for a in {r.adapter_id for r in requests if r.backward}}
    return outs, grads


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling", "CrossEntropyLoss",
                                  "GRPOLoss"])
def test_a_pass_in_pieces_equals_the_pass_in_one(engine, datums, add, loss):
    rl = loss in ("importance_sampling", "GRPOLoss")
    requests = [ForwardRequest("a", _rl(datums[:5], 1) if rl else datums[:5], LossSpec(loss),
                               True),
                ForwardRequest("b", _rl(datums[3:], 2) if rl else datums[3:], LossSpec(loss),
                               True),
                ForwardRequest("c", datums[:2], LossSpec("cross_entropy"), False)]
    for name in ("whole", "pieces"):
        for adapter in "abc":
            add(f"{adapter}-{name}", SPEC)
    assert len(pieces([d.num_tokens for r in requests for d in r.datums], CAP)) >= 3
    whole, whole_grads = _run(engine, "whole", requests, 0)
    split, split_grads = _run(engine, "pieces", requests, CAP)
    for got, want in zip(split, whole, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=LOSS_RTOL)
        assert got.metrics.keys() == want.metrics.keys()
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            np.testing.assert_allclose(a, b, atol=LOGPROB_ATOL, rtol=0)
    for adapter, grad in whole_grads.items():
        assert_grads_close(split_grads[adapter], grad)


def test_a_datum_longer_than_the_cap_runs_as_its_own_piece(engine, datums, add):
    add("long-whole", SPEC)
    add("long-pieces", SPEC)
    request = [ForwardRequest("long", datums[:3], LossSpec("cross_entropy"), True)]
    (whole,), whole_grads = _run(engine, "whole", request, 0)
    (split,), split_grads = _run(engine, "pieces", request, 4)
    assert split.loss == pytest.approx(whole.loss, rel=LOSS_RTOL)
    assert_grads_close(split_grads["long"], whole_grads["long"])


@pytest.mark.parametrize("error", [MemoryError, torch.OutOfMemoryError])
def test_running_out_of_memory_part_way_fails_the_pass_and_leaves_every_gradient(
        engine, datums, add, error):
    add("kept", SPEC)
    request = [ForwardRequest("kept", datums, LossSpec("cross_entropy"), True)]
    engine.forward_batch(request)  # some gradient to keep
    before = [p.grad.clone() for p in engine.adapters["kept"].parameters()]
    adapter = engine.adapters["kept"]
    counters = replace(adapter.train_metrics), adapter.tokens_seen
    saved = engine.limits
    engine.limits = replace(saved, max_pass_tokens=CAP)
    try:
        with failing_replay(error):
            (out,) = engine.forward_batch(request)
    finally:
        engine.limits = saved
    assert isinstance(out, ResourceExhausted)
    assert "ran out of memory" in str(out) and "--max-pass-tokens" in str(out)
    for param, grad in zip(engine.adapters["kept"].parameters(), before, strict=True):
        assert torch.equal(param.grad, grad)
    assert (adapter.train_metrics, adapter.tokens_seen) == counters
