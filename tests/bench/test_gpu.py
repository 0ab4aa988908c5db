"""bench.gpu runs on an accelerator only when a session is lent one: its smoke run on CPU
keeps the script and its GPU tests (`tests/gpu`, run on tiny shapes on the CPU) working
in between, and shows that those tests can fail."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ..timeouts import SUBPROCESS_TIMEOUT_S, WAITS_FOR_A_SUBPROCESS

pytestmark = WAITS_FOR_A_SUBPROCESS

ROWS = ("engine 2 x 64, pieces <= 96", "engine 2 x 64, one piece",
        "8 tenants x 1 x 32 merged", "8 tenants x 1 x 32 timeshare",
        "8 x 2 of 8..64 tokens, packed", "8 x 2 of 8..64 tokens, padded",
        "engine 2 x 64, pieces <= 96, activation ckpt", "transformers + peft 2 x 64",
        "engine 2 x 64, pieces <= 96, FSDP2 1 rank")
GPU_TESTS = ("test_packed_and_padded_passes_agree_in_the_run_dtype",
             "test_packed_and_padded_passes_agree_in_float32",
             "test_a_packed_datum_ignores_another_datums_tokens",
             "test_activation_checkpointing_trains_as_without")

# Attention across a packed pass's datums: its boundaries replaced by one segment; then
# the GPU tests, in this process (so the patch holds), on the CPU.
LEAKING = """
import sys, torch
from twinkle_server.engine import packing
real = packing.PassLayout.model_inputs
def leaking(self, base, ids):
    out = real(self, base, ids)
    if self.packed:
        whole = torch.tensor([0, self.total], dtype=torch.int32)
        out.update(cu_seq_lens_q=whole, cu_seq_lens_k=whole, max_length_q=self.total,
                   max_length_k=self.total)
    return out
packing.PassLayout.model_inputs = leaking
import pytest
sys.exit(pytest.main(["-m", "gpu", "-p", "no:cacheprovider", "-rf", "tests/gpu"]))
"""


def _summary(stdout: str) -> list[str]:
    """The closing table (rows are also printed as they are measured) and what follows."""
    return stdout[stdout.index("rank 16 all-linear"):].splitlines()


def _run(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *command], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S, env={**os.environ, **(env or {})})


@pytest.mark.integration
@pytest.mark.bench_smoke
def test_the_smoke_run_prints_every_row_and_passes_the_gpu_tests(tiny_cache):
    done = _run("-m", "bench.gpu", "--device", "cpu", "--small")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = _summary(done.stdout)
    for row in ROWS:
        assert any(row in line and "out of memory" not in line for line in summary), row
    assert "split, 1 sampler rank" in done.stdout, done.stdout[-3000:]
    tests = "\n".join(summary)
    assert all(test in tests for test in GPU_TESTS) and f"{len(GPU_TESTS)} passed" in tests


def test_an_adapter_the_headroom_estimate_refuses_is_measured_anyway_and_said(
        tiny_cache, monkeypatch, capsys):
    """Each row adds its adapter through `add_measured_adapter`: where the engine's
    headroom reserve refuses it (free memory read as 10 kB), the row still runs, says so,
    and the reserve's reading is put back for the next row."""
    import twinkle_server.engine.engine as engine_module
    from bench import gpu
    from twinkle_server.engine.engine import Engine
    from twinkle_server.engine.errors import ResourceExhausted
    from twinkle_server.engine.types import LoraSpec

    engine = Engine.load("tiny", cache_dir=str(tiny_cache))
    monkeypatch.setattr(engine_module, "available_memory_bytes", lambda device: 10_000)
    with pytest.raises(ResourceExhausted):
        engine.add_adapter("plain", LoraSpec(rank=4, alpha=8))
    gpu.add_measured_adapter(engine, "engine 2 x 64", "measured")
    assert "measured" in engine.adapters
    assert "engine 2 x 64: the engine refuses the adapter" in capsys.readouterr().out
    assert engine_module.available_memory_bytes(engine.base.device) == 10_000


@pytest.mark.integration
def test_attention_leaking_across_packed_datums_fails_the_gpu_tests(tiny_cache):
    done = _run("-c", LEAKING, env={"TWINKLE_GPU_TESTS_DEVICE": "cpu"})
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert any("test_a_packed_datum_ignores_another_datums_tokens" in line
               for line in failed), failed
    assert any("test_packed_and_padded_passes_agree_in_float32" in line
               for line in failed), failed
