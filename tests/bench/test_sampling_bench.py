"""bench.sampling's smoke run (`--quick --model tiny`, about 35 s on 2 CPU cores): every
section runs against real server processes and prints its summary row. Timings are not
checked; the prefill row is a count: a group of 16 samples computes its prompt once."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from ..timeouts import SUBPROCESS_TIMEOUT_S, WAITS_FOR_A_SUBPROCESS

pytestmark = WAITS_FOR_A_SUBPROCESS

ROWS = ("groups 8 x 8 x 32: tinker_compat over gRPC vs generate",
        "groups 8 x 8 x 32: tinker SDK over HTTP vs generate",
        "groups 32 x 16 x 16: tinker_compat over gRPC vs generate",
        "groups 32 x 16 x 16: tinker SDK over HTTP vs generate",
        "mixed lengths: continuous vs static",
        "training latency during sampling: continuous",
        "training latency during sampling: static",
        "GRPO prefill, num_samples 16: prompt tokens computed")


@pytest.mark.integration
@pytest.mark.bench_smoke
def test_the_quick_run_prints_every_row_and_one_prefill_per_group(tiny_cache):
    # A bound against a hang, not a timing: on 2 cores shared with other jobs the run took
    # 166 s alone, and longer beside other tests (35 s on a quiet machine).
    done = subprocess.run([sys.executable, "-m", "bench.sampling", "--quick", "--model",
                           "tiny"], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout[done.stdout.index("summary ("):].splitlines()
    for row in ROWS:
        assert any(line.startswith(f"| {row} |") and re.search(r"\*\*\d+\.\d\dx\*\*", line)
                   for line in summary), row
    prefill = next(line for line in summary if "GRPO prefill" in line)
    assert "| 32 for a 32-token prompt | **1.00x** |" in prefill, prefill
    assert "computed / prompt length: 1.00x" in done.stdout
