"""The GPU tests' run: its device and sizes (`bench.gpu_shapes.GpuRun`), a base of the
first benchmark shape (Qwen3-0.6B) with random weights, and an adapter trained on it.

The tests run on one CUDA device: `python3 -m bench.gpu` runs them after its table, or
`python -m pytest -m gpu tests/gpu` alone. Where torch sees no CUDA device (`make test`
on a CPU machine) each one skips. `TWINKLE_GPU_TESTS_DEVICE=cpu` runs them on the CPU on
tiny shapes (what the smoke run `bench.gpu --device cpu --small` does: the same code
path, numbers that mean nothing for a GPU); `TWINKLE_GPU_TESTS_SMALL=1` picks the tiny
shapes on a GPU too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from bench.data import random_datums
from bench.gpu_shapes import SPEC, GpuRun, build_model, free, load_engine, train_steps

DEVICE_ENV = "TWINKLE_GPU_TESTS_DEVICE"
SMALL_ENV = "TWINKLE_GPU_TESTS_SMALL"
TRAIN_STEPS = 4
"""Steps the adapter is trained (the benchmark's warmup and 3 timed steps): enough to
move LoRA's B off its zero start, so a pass's adapter routing shows in its numbers."""
ADAPTER = "bench"


@dataclass(frozen=True)
class Trained:
    """`SPEC`'s adapter after `TRAIN_STEPS` training steps: its weights and each loss."""

    adapter_dir: Path
    losses: list[float]


@pytest.fixture(scope="session")
def gpu_run() -> GpuRun:
    device = os.environ.get(DEVICE_ENV, "cuda")
    on_cuda = torch.device(device).type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False): these tests need "
                    "one CUDA device (python3 -m bench.gpu runs them there); "
                    f"{DEVICE_ENV}=cpu runs them on tiny shapes on the CPU")
    return GpuRun.of(device, small=not on_cuda or os.environ.get(SMALL_ENV) == "1")


@pytest.fixture(scope="session")
def model_dir(gpu_run: GpuRun, tiny_cache, tmp_path_factory) -> Path:
    """The run's first shape (Qwen3-0.6B, or `small`) with random weights, in the run's
    dtype, with the tiny model's tokenizer."""
    name, shape = next(iter(gpu_run.shapes.items()))
    out = tmp_path_factory.mktemp(name)
    device = torch.device(gpu_run.device)
    build_model(out, shape, getattr(torch, gpu_run.dtype), device)
    free(device)
    return out


@pytest.fixture(scope="session")
def trained(gpu_run: GpuRun, model_dir: Path, tmp_path_factory) -> Trained:
    """`SPEC`'s adapter trained `TRAIN_STEPS` steps (forward_backward + optim_step of
    `rows x length` tokens, in pieces of the run's pass cap) in the run's dtype, saved."""
    engine = load_engine(model_dir, gpu_run)
    engine.add_adapter(ADAPTER, SPEC)
    batch = random_datums(gpu_run.rows, gpu_run.length, engine.base.vocab_size)
    losses: list[float] = []
    step = train_steps(engine, ADAPTER, batch, losses)
    for _ in range(TRAIN_STEPS):
        step()
    out = tmp_path_factory.mktemp("adapter") / ADAPTER
    engine.save_weights(ADAPTER, out)
    del engine, step
    free(torch.device(gpu_run.device))
    return Trained(out, losses)


@pytest.fixture
def load(gpu_run: GpuRun, model_dir: Path) -> Iterator[Callable[..., object]]:
    """`load(dtype=None, **options)`: an engine on the base (`load_engine`); what the test
    loaded is freed after it."""
    yield lambda dtype=None, **options: load_engine(model_dir, gpu_run, dtype, **options)
    free(torch.device(gpu_run.device))
