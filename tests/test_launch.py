"""Serving from several ranks (`--nproc-per-node`): the launched job survives idleness,
fails fast and loudly when a rank dies, and restarts from its data dir."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tinker_compat import RestClient, ServiceClient
from twinkle_server.process import start_server

from .numerics import LOGPROB_ATOL
from .tinker_compat.conftest import sft_data

pytestmark = pytest.mark.integration

TIMEOUT_S = 4
"""`--collective-timeout` in these tests: a lost rank must be reported well within it."""


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of rank `rank` among the launcher's descendants (its RANK env var)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            parent = int(entry)
            while parent > 1 and parent != launcher:
                parent = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher and f"RANK={rank}".encode() in env and int(entry) != launcher:
            return int(entry)
    raise AssertionError(f"no rank {rank} under pid {launcher}")


def test_a_killed_rank_fails_ops_unavailable_and_a_restart_resumes(tmp_path, tiny_cache):
    data_dir = tmp_path / "data"
    server = start_server(data_dir, "--nproc-per-node", "2",
                          "--collective-timeout", str(TIMEOUT_S))
    prompt = types.ModelInput.from_ints([5, 17, 29, 3, 88, 41])
    batch = sft_data(n=4, seed=1)
    service = ServiceClient(base_url=f"http://{server.address}")
    try:
        training = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        training.forward_backward(batch, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = training.save_state("before-kill").result().path
        sampler = training.save_weights_and_get_sampling_client().result()
        want = sampler.compute_logprobs(prompt).result()[1:]
        # Idle for longer than the collective timeout: rank 0 keeps the others waiting
        # within it, so the next op still runs.
        time.sleep(2 * TIMEOUT_S)
        training.forward_backward(batch, "cross_entropy").result()

        os.kill(_rank_pid(server.proc.pid, 1), signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(tinker.APIConnectionError, match="rank 1"):
            training.forward_backward(batch, "cross_entropy").result()
        assert time.monotonic() - started < TIMEOUT_S + 5  # the heartbeat check takes 3 s
        assert server.proc.wait(60) != 0
    finally:
        service.close()
        if server.proc.poll() is None:
            server.proc.kill()

    # Restarted (on one rank this time) on the same data dir: every checkpoint reported
    # saved is listed and loads to the same weights.
    restarted = start_server(data_dir)
    service = ServiceClient(base_url=f"http://{restarted.address}")
    try:
        rest = RestClient(base_url=f"http://{restarted.address}")
        listed = {c.tinker_path for run in rest.list_training_runs().result().training_runs
                  for c in rest.list_checkpoints(run.training_run_id).result().checkpoints}
        assert state in listed and sampler.model_path in listed
        resumed = service.create_training_client_from_state_with_optimizer(state).result()
        got = resumed.save_weights_and_get_sampling_client().result().compute_logprobs(
            prompt).result()[1:]
        np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)
    finally:
        service.close()
        restarted.stop()
