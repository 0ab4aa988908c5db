"""A step never applies a window a failed forward_backward left partial
(`scheduling.executor`): the executor over the real tiny engine, its ops as the
scheduler hands them over."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.errors import FailedPrecondition, InvalidArgument
from twinkle_server.engine.types import AdamParams, Datum, EngineLimits, LoraSpec, LossSpec
from twinkle_server.scheduling.executor import FORWARD, EngineExecutor
from twinkle_server.scheduling.planning import Op

CE = LossSpec("cross_entropy")
ADAM = AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def engine(tiny_cache) -> Engine:
    return Engine.load("tiny", cache_dir=str(tiny_cache),
                       limits=EngineLimits(max_adapters=4, max_rank=8, max_seq_len=64,
                                           max_batch_tokens=512))


def _datum(seed: int) -> Datum:
    ids = np.random.default_rng(seed).integers(5, 200, 17)
    return Datum(ids[:-1], {"target_tokens": ids[1:], "weights": np.ones(16, np.float32)})


def _forward(model: str, seq: int) -> Op:
    return Op(model, seq, "forward_backward", FORWARD, 16,
              ForwardRequest(model, [_datum(seq)], CE, True))


def _refused(model: str, seq: int) -> Op:
    return Op.failed(model, seq, "forward_backward", InvalidArgument("datum[0]: bad"))


def _step(engine: Engine, model: str, seq: int) -> Op:
    return Op(model, seq, "optim_step", None, 0, lambda: engine.optim_step(model, ADAM))


def _weights(engine: Engine, model: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.adapters[model].parameters()]


def test_a_step_after_a_failed_chunk_beside_trained_ones_is_refused_and_applies_nothing(
        engine):
    """Chunks 2 and 3 of a call trained, chunk 1 was refused: the step is refused naming
    the failure, the weights are as before, and the gradients are gone; the next window
    steps as usual."""
    engine.add_adapter("partial", LoraSpec(rank=4, alpha=8, seed=1))
    executor = EngineExecutor(engine)
    before = _weights(engine, "partial")
    for op in (_refused("partial", 0), _forward("partial", 1), _forward("partial", 2)):
        executor.run_batch([op])
    refused, = executor.run_batch([_step(engine, "partial", 3)])
    assert isinstance(refused, FailedPrecondition), refused
    assert "a forward_backward since the last step failed (datum[0]: bad)" in str(refused)
    for got, want in zip(_weights(engine, "partial"), before, strict=True):
        assert torch.equal(got, want)
    assert all(p.grad is None or not p.grad.any()
               for p in engine.adapters["partial"].parameters())
    executor.run_batch([_forward("partial", 4)])
    stepped, = executor.run_batch([_step(engine, "partial", 5)])
    assert isinstance(stepped, dict), stepped
    assert any(not torch.equal(got, want) for got, want in
               zip(_weights(engine, "partial"), before, strict=True))


def test_a_window_whose_only_forward_backward_failed_steps_as_usual(engine):
    """Nothing of the failed call was added, so there is nothing partial to refuse: the
    step runs (an optimizer step with no gradient moves no weight)."""
    engine.add_adapter("alone", LoraSpec(rank=4, alpha=8, seed=2))
    executor = EngineExecutor(engine)
    before = _weights(engine, "alone")
    executor.run_batch([_refused("alone", 0)])
    stepped, = executor.run_batch([_step(engine, "alone", 1)])
    assert isinstance(stepped, dict), stepped
    for got, want in zip(_weights(engine, "alone"), before, strict=True):
        assert torch.equal(got, want)
