"""The engine's numerics on a CUDA device, whose kernels are not the CPU's: flash sdpa in
bf16, memory-efficient sdpa in float32, cuBLAS's GEMMs. On a Qwen3-0.6B-shaped base with
an adapter trained there (`conftest.trained`):

- packed and padded merged passes give the same logprobs, in bf16 and in float32;
- in a packed pass, a datum's logprobs do not depend on another datum's tokens;
- activation checkpointing on and off train to the same loss.

The CPU suite holds the 4-layer tiny model to the isolation contract's float32
tolerances (`tests/numerics.py`, `tests/engine/test_packing.py`); these hold a 28-layer
model on the accelerator. Each test prints what it measured beside its tolerance (`-s`,
as `bench.gpu` runs them), the figures that would calibrate a tighter bound.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.data import mixed_datums, random_datums
from bench.gpu_shapes import SPEC, GpuRun, check_datums, forward_logprobs, one_piece, train_steps

from .conftest import ADAPTER, TRAIN_STEPS, Trained

pytestmark = pytest.mark.gpu

# float32: a 28-layer pass summed in other orders (other GEMM shapes, another attention
# kernel) drifts ~1e-6 a layer; the CPU tests hold the 4-layer tiny model to 1e-5.
FLOAT32_LOGPROB_ATOL = 1e-4
# bf16 (unit roundoff 2^-8 = 3.9e-3 on every activation, accumulations in float32) only
# catches gross errors: a datum attending to another moves its logprobs by far more.
BF16_LOGPROB_ATOL = 0.1
# Isolation compares the same shapes (only one datum's token values change), so only
# kernel non-determinism remains.
ISOLATION_ATOL = 1e-5
# Checkpointing on and off run the same math in bf16, but the recomputed forward and the
# pieces (its pass cap is larger) round differently over 4 steps: 1e-2 of the loss is
# about 2.5 bf16 unit roundoffs, far below what a wrong recomputed gradient moves it.
BF16_LOSS_RTOL = 1e-2


def _measured(what: str, value: float, tolerance: float) -> float:
    print(f"\n{what}: {value:.3g} (tolerance {tolerance:.0e})")
    return value


def _with_trained(load, trained: Trained, dtype: str | None = None):
    """An engine (in `dtype`, default the run's) holding the trained adapter."""
    engine = load(dtype)
    engine.add_adapter(ADAPTER, SPEC)
    engine.load_state(ADAPTER, trained.adapter_dir, include_optimizer=False)
    return engine


def _packed_vs_padded(engine, run: GpuRun) -> float:
    """Max |logprob difference| between a padded and a packed forward-only pass (each in
    one piece) over datums of mixed lengths."""
    datums = check_datums(engine.base.vocab_size, run)
    with one_piece(engine):
        engine.packing = False
        padded = forward_logprobs(engine, ADAPTER, datums)
        engine.packing = True
        packed = forward_logprobs(engine, ADAPTER, datums)
    return max(float(np.abs(a - b).max()) for a, b in zip(packed, padded, strict=True))


def test_packed_and_padded_passes_agree_in_the_run_dtype(gpu_run, trained, load):
    """bf16 on a GPU (flash sdpa); float32 on the CPU smoke run."""
    bf16 = gpu_run.dtype == "bfloat16"
    atol = BF16_LOGPROB_ATOL if bf16 else FLOAT32_LOGPROB_ATOL
    diff = _packed_vs_padded(_with_trained(load, trained), gpu_run)
    assert _measured(f"{gpu_run.dtype} packed vs padded, max |logprob diff|", diff,
                     atol) <= atol


def test_packed_and_padded_passes_agree_in_float32(gpu_run, trained, load):
    """float32 (memory-efficient sdpa on a GPU), with the adapter trained in the run's
    dtype."""
    diff = _packed_vs_padded(_with_trained(load, trained, "float32"), gpu_run)
    assert _measured("float32 packed vs padded, max |logprob diff|", diff,
                     FLOAT32_LOGPROB_ATOL) <= FLOAT32_LOGPROB_ATOL


def test_a_packed_datum_ignores_another_datums_tokens(gpu_run, trained, load):
    """In one packed float32 pass, datum 1's logprobs whatever datum 0's tokens are."""
    engine = _with_trained(load, trained, "float32")
    vocab = engine.base.vocab_size
    first, second = mixed_datums(2, *gpu_run.mixed_lengths, vocab, seed=7)
    changed = random_datums(1, first.num_tokens, vocab, seed=99)[0]
    with one_piece(engine):
        before = forward_logprobs(engine, ADAPTER, [first, second])[1]
        after = forward_logprobs(engine, ADAPTER, [changed, second])[1]
    diff = float(np.abs(before - after).max())
    assert _measured("float32 packed: other datum's tokens changed, max |logprob diff|",
                     diff, ISOLATION_ATOL) <= ISOLATION_ATOL


def test_activation_checkpointing_trains_as_without(gpu_run, trained, load):
    """The same seeded adapter, data and steps with `--activation-checkpointing on` reach
    the loss the adapter trained without it reached."""
    engine = load(activation_checkpointing=True)
    engine.add_adapter(ADAPTER, SPEC)
    batch = random_datums(gpu_run.rows, gpu_run.length, engine.base.vocab_size)
    losses: list[float] = []
    step = train_steps(engine, ADAPTER, batch, losses)
    for _ in range(TRAIN_STEPS):
        step()
    plain = trained.losses[-1]
    relative = abs(losses[-1] - plain) / abs(plain)
    assert _measured(f"activation ckpt on vs off, loss after {TRAIN_STEPS} steps, relative "
                     "diff", relative, BF16_LOSS_RTOL) <= BF16_LOSS_RTOL
