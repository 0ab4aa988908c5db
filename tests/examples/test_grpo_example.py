"""examples/grpo_tinker_client.py end to end: it starts its own server on the tiny model,
warms up, runs GRPO, writes the reward PNG, and the mean reward rises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..timeouts import SUBPROCESS_TIMEOUT_S, WAITS_FOR_A_SUBPROCESS

pytestmark = [pytest.mark.integration, WAITS_FOR_A_SUBPROCESS]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_tinker_client.py"
STEPS = 12  # GRPO steps: seeds 0, 1 and 2 all end above where they start
K = 3  # steps averaged at each end of the reward curve


def test_the_grpo_example_raises_the_reward(tiny_cache, tmp_path, monkeypatch):
    monkeypatch.delenv("TWINKLE_BASE_URL", raising=False)
    plot = tmp_path / "grpo.png"
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--seed", "0",
                           "--plot", str(plot)],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    rewards = [float(x) for x in re.findall(r"^step +\d+ +reward ([\d.]+)", out, re.M)]
    assert len(rewards) == STEPS, out
    assert re.search(r"^reward: first [\d.]+ -> last [\d.]+$", out, re.M), out
    assert sum(rewards[-K:]) / K > sum(rewards[:K]) / K, rewards
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
