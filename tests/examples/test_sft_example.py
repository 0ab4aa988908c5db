"""examples/sft_twinkle_client.py end to end against a real server: it trains (the loss
falls), saves a checkpoint per epoch, writes the PNG, and resumes from the newest one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle_server.process import start_server

from ..timeouts import SUBPROCESS_TIMEOUT_S, WAITS_FOR_A_SUBPROCESS

pytestmark = [pytest.mark.integration, WAITS_FOR_A_SUBPROCESS]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sft_twinkle_client.py"


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("example-server"))
    yield proc
    proc.stop()


def _run(server, *args: str) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLE), "--base-url",
                           f"http://{server.address}", *args],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_the_sft_example_trains_saves_plots_and_resumes(server, tmp_path):
    plot = tmp_path / "loss.png"
    out = _run(server, "--rows", "8", "--epochs", "6", "--steps", "10", "--grad-accum", "1",
               "--lr", "5e-3", "--rank", "16", "--lora-alpha", "32", "--seed", "0",
               "--plot", str(plot))
    losses = [float(x) for x in re.findall(r"step +\d+ +loss ([\d.]+)", out)]
    assert len(losses) == 10
    assert losses[-1] < losses[0] - 1.0, losses
    assert "epoch 4 metrics:" in out and "Saved checkpoint: twinkle://" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    resumed = _run(server, "--rows", "8", "--steps", "1", "--grad-accum", "1", "--rank", "16",
                   "--lora-alpha", "32", "--resume", "--plot", str(tmp_path / "again.png"))
    assert re.search(r"Resuming training from twinkle://run-\w+/weights/twinkle-epoch-4",
                     resumed), resumed
