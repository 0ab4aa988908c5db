"""What the GPU benchmark (`bench.gpu`) and the GPU tests (`tests/gpu/`) both run on:
Qwen3-shaped bases with random weights (no download), the sizes of one run, loading an
`Engine` on them, and the few engine calls both make."""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from bench.data import mixed_datums
from twinkle_server.engine.types import (
    AUTO_PASS_TOKENS,
    AdamParams,
    Datum,
    EngineLimits,
    LoraSpec,
    LossSpec,
)

# Published sizes (the models' config.json on the Hugging Face hub).
SHAPES: dict[str, dict] = {
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       vocab_size=151_936, tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151_936, tie_word_embeddings=True),
}
SMALL_SHAPES: dict[str, dict] = {
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=4096,
                  tie_word_embeddings=True),
}
CE = LossSpec("cross_entropy")
ADAM = AdamParams(learning_rate=1e-4)
SPEC = LoraSpec(rank=16, alpha=32, seed=0)
TENANTS = 8
CHECK_DATUMS = 6
"""Datums of mixed lengths the packing checks compare (`check_datums`)."""


@dataclass(frozen=True)
class GpuRun:
    """Where one run goes and how big it is: bf16 on a CUDA device, float32 elsewhere;
    `small` is the smoke run's tiny shapes and batches."""

    device: str
    dtype: str
    small: bool
    rows: int
    length: int
    tenant_length: int
    mixed_lengths: tuple[int, int]
    pass_tokens: int
    """The engine's pass cap: a server's default (picked from the memory free), or, in
    the smoke run, 3/2 of a datum, so its 2 x 64 passes go in pieces as the 4B shape's
    are expected to on a GPU."""
    steps: int

    @classmethod
    def of(cls, device: str, small: bool) -> GpuRun:
        length = 64 if small else 2048
        return cls(device=device,
                   dtype="bfloat16" if torch.device(device).type == "cuda" else "float32",
                   small=small, rows=2 if small else 8, length=length,
                   tenant_length=32 if small else 512,
                   mixed_lengths=(8, 64) if small else (64, 2048),
                   pass_tokens=3 * length // 2 if small else AUTO_PASS_TOKENS,
                   steps=2 if small else 3)

    @property
    def shapes(self) -> dict[str, dict]:
        return SMALL_SHAPES if self.small else SHAPES


def build_model(out: Path, shape: dict, dtype: torch.dtype, device: torch.device) -> None:
    """A random Qwen3 of `shape` saved to `out` with the tiny model's tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from twinkle_server.engine.tiny_model import build_tiny_model

    tiny = build_tiny_model()
    config = Qwen3Config(**shape, max_position_embeddings=40_960, rope_theta=1_000_000.0,
                         bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(out)
    del model
    for f in Path(tiny).iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out)


def free(device: torch.device) -> None:
    """Collect what was dropped (engines hold reference cycles) and return the cached
    device memory, so the next load's pass cap sees the memory free."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def load_engine(path: Path, run: GpuRun, dtype: str | None = None, **options):
    """An `Engine` on `path` with the run's limits and pass cap (`run.pass_tokens`), in
    `dtype` (default the run's); `options` go to `Engine.load`."""
    from twinkle_server.engine.engine import Engine

    limits = EngineLimits(max_adapters=TENANTS + 2, max_seq_len=run.length,
                          max_batch_tokens=max(run.rows * run.length,
                                               CHECK_DATUMS * run.mixed_lengths[1]),
                          max_pass_tokens=run.pass_tokens)
    return Engine.load(str(path), device=run.device, dtype=dtype or run.dtype,
                       limits=limits, **options)


def run_batch(engine, requests: list) -> list:
    """`engine.forward_batch(requests)`, raising the first request's failure (the engine
    returns failures, running out of memory included, as values)."""
    outputs = engine.forward_batch(requests)
    for out in outputs:
        if isinstance(out, Exception):
            raise out
    return outputs


def train_steps(engine, adapter_id: str, batch: list[Datum], losses: list[float]
                ) -> Callable[[], None]:
    """One forward_backward + optim_step of `batch`; each step's loss goes to `losses`."""
    from twinkle_server.engine.engine import ForwardRequest

    def step() -> None:
        (out,) = run_batch(engine, [ForwardRequest(adapter_id, batch, CE, True)])
        losses.append(out.loss)
        engine.optim_step(adapter_id, ADAM)

    return step


def forward_logprobs(engine, adapter_id: str, datums: list[Datum]) -> list[np.ndarray]:
    """Each datum's target logprobs from one forward-only pass."""
    from twinkle_server.engine.engine import ForwardRequest

    return run_batch(engine, [ForwardRequest(adapter_id, datums, CE, False)])[0].logprobs


@contextmanager
def one_piece(engine) -> Iterator[None]:
    """Passes in one piece, whatever the engine's pass cap (`--max-pass-tokens`)."""
    capped = engine.limits
    engine.limits = replace(capped, max_pass_tokens=0)
    try:
        yield
    finally:
        engine.limits = capped


def check_datums(vocab: int, run: GpuRun) -> list[Datum]:
    """`CHECK_DATUMS` datums of lengths drawn from `run.mixed_lengths`: the first of the
    benchmark's mixed-length tenant batches (seeds 0, 1, 2)."""
    low, high = run.mixed_lengths
    return [d for seed in range(CHECK_DATUMS // 2)
            for d in mixed_datums(2, low, high, vocab, seed=seed)]
