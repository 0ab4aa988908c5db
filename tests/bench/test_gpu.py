"""bench.gpu runs on an accelerator only when a session is lent one: its smoke run on CPU
keeps the script working in between, and shows that its checks can fail."""

from __future__ import annotations

import subprocess
import sys

import pytest

ROWS = ("engine 2 x 64, pieces <= 96", "engine 2 x 64, one piece",
        "8 tenants x 1 x 32 merged", "8 tenants x 1 x 32 timeshare",
        "8 x 2 of 8..64 tokens, packed", "8 x 2 of 8..64 tokens, padded",
        "engine 2 x 64, pieces <= 96, activation ckpt", "transformers + peft 2 x 64",
        "engine 2 x 64, pieces <= 96, FSDP2 1 rank")
CHECKS = ("packed vs padded", "activation ckpt on vs off", "other datum's tokens changed")

# Attention across a packed pass's datums: its boundaries replaced by one segment.
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
from bench import gpu
sys.exit(gpu.main(["--device", "cpu", "--small"]))
"""


# An accelerator's headroom reserve refusing every adapter (free memory read as 10 kB).
REFUSING = """
import sys
import twinkle_server.engine.engine as engine_module
engine_module.available_memory_bytes = lambda device: 10_000
from bench import gpu
sys.exit(gpu.main(["--device", "cpu", "--small"]))
"""


def _summary(stdout: str) -> list[str]:
    """The closing table and checks (rows are also printed as they are measured)."""
    return stdout[stdout.index("rank 16 all-linear"):].splitlines()


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *command], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.integration
@pytest.mark.parametrize("command", [("-m", "bench.gpu", "--device", "cpu", "--small"),
                                     ("-c", REFUSING)], ids=["plain", "adapters-refused"])
def test_the_smoke_run_prints_every_row_and_passes_every_check(tiny_cache, command):
    done = _run(*command)
    assert done.returncode == 0, done.stderr[-3000:]
    if "-c" in command:
        assert "refuses the adapter" in done.stdout and "measuring anyway" in done.stdout
    summary = _summary(done.stdout)
    for row in ROWS:
        assert any(row in line and "out of memory" not in line for line in summary), row
    checks = [line for line in summary if line.rstrip().endswith(("ok", "FAILED"))]
    assert checks and all(line.rstrip().endswith("ok") for line in checks), checks
    for check in CHECKS:
        assert any(check in line for line in checks), check


@pytest.mark.integration
def test_attention_leaking_across_packed_datums_fails_the_checks(tiny_cache):
    done = _run("-c", LEAKING)
    assert done.returncode == 1, done.stderr[-3000:]
    failed = [line for line in _summary(done.stdout) if line.rstrip().endswith("FAILED")]
    assert any("other datum's tokens changed" in line for line in failed), failed
    assert any("packed vs padded" in line for line in failed), failed
