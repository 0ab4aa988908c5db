"""examples/sft_tinker_client.py end to end against a real server: the Tinker-API SFT loop
trains (loss per answer token falls), saves a checkpoint per epoch and writes the PNG."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle_server.process import start_server

from ..timeouts import SUBPROCESS_TIMEOUT_S, WAITS_FOR_A_SUBPROCESS

pytestmark = [pytest.mark.integration, WAITS_FOR_A_SUBPROCESS]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft_tinker_client.py"


def test_the_tinker_sft_example_trains_saves_and_plots(tmp_path, tiny_cache):
    server = start_server(tmp_path / "data")
    try:
        plot = tmp_path / "loss.png"
        done = subprocess.run([sys.executable, str(EXAMPLE), "--base-url",
                               f"http://{server.address}", "--rows", "8", "--batch-size", "8",
                               "--epochs", "6", "--plot", str(plot)],
                              capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
        out = done.stdout + done.stderr
        assert done.returncode == 0, out
        losses = [float(x) for x in re.findall(r"loss/token ([\d.]+)", out)]
        assert len(losses) == 6
        assert losses[-1] < losses[0] - 1.0, losses
        assert len(re.findall(r"Saved checkpoint to tinker://run-\w+/weights/twinkle-lora-\d",
                              out)) == 6
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        server.stop()
