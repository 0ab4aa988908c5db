"""bench.turns' smoke run at small sizes: every base prints its line, and the counts are
exact: a session's second turn computes only what its first turn's prompt and
completion did not hold, on every layer kind. Timings are not checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..timeouts import SUBPROCESS_TIMEOUT_S, WAITS_FOR_A_SUBPROCESS

pytestmark = WAITS_FOR_A_SUBPROCESS

BASES = ("full attention", "sliding window 128", "hybrid (Gated DeltaNet)")


@pytest.mark.bench_smoke
def test_a_second_turn_computes_only_its_new_tokens_on_every_base(tiny_cache):
    done = subprocess.run([sys.executable, "-m", "bench.turns", "--conversations", "2",
                           "--turns", "2", "--prompt", "32", "--reply", "4", "--ask", "4",
                           "--rounds", "1"], capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = {line[2:30].strip(): line[30:].split() for line in done.stdout.splitlines()
             if line.startswith("  ") and line[2:30].strip() in BASES}
    assert set(lines) == set(BASES), done.stdout
    # Two conversations: 2 x 32 tokens, then 2 x (32 + 4 + 4); the second turn reuses the
    # first's prompt and completion but its last token (never fed): 2 x 35.
    for base, (_, computed, _, reused, cached, _) in lines.items():
        assert (int(computed), int(reused), int(cached)) == (144, 74, 70), base
