"""Serving from several ranks (`--nproc-per-node`): the launched job survives idleness,
fails fast and loudly when a rank dies, and restarts from its data dir."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tinker_compat import RestClient, ServiceClient
from twinkle_server.process import start_server

from ..numerics import LOGPROB_ATOL, LOSS_RTOL
from ..tinker_compat.conftest import sft_data

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


@pytest.mark.long
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
    # saved is listed and loads to the same weights; the ephemeral sampler weights were
    # never a checkpoint, and went with their sampling session.
    restarted = start_server(data_dir)
    service = ServiceClient(base_url=f"http://{restarted.address}")
    try:
        rest = RestClient(base_url=f"http://{restarted.address}")
        listed = {c.tinker_path for run in rest.list_training_runs().result().training_runs
                  for c in rest.list_checkpoints(run.training_run_id).result().checkpoints}
        assert listed == {state} and sampler.model_path is None
        assert not (data_dir / "sampler-snapshots").exists()
        resumed = service.create_training_client_from_state_with_optimizer(state).result()
        got = resumed.save_weights_and_get_sampling_client().result().compute_logprobs(
            prompt).result()[1:]
        np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)
    finally:
        service.close()
        restarted.stop()


def _shares(log: str) -> dict[tuple[str, int], tuple[int, int]]:
    """(when, rank) -> (bytes held, base bytes), from the ranks' log lines."""
    return {(when, int(rank)): (int(mine), int(total)) for when, rank, mine, total in
            re.findall(r"(loaded|stopping): rank (\d+) of \d+ holds (\d+) of the base's (\d+) "
                       r"parameter bytes", log)}


def _one_step(address: str) -> float:
    service = ServiceClient(base_url=f"http://{address}")
    try:
        training = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        out = training.forward_backward(sft_data(n=3, seed=2), "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1,
                       types.SamplingParams(max_tokens=4, seed=1)).result()
        return out.metrics["loss:sum"]
    finally:
        service.close()


def test_each_rank_holds_half_of_the_base_before_and_after_training(tmp_path, tiny_cache):
    server = start_server(tmp_path / "data", "--nproc-per-node", "2")
    _one_step(server.address)
    assert server.stop() == 0, server.log()[-3000:]
    shares = _shares(server.log())
    assert sorted(shares) == [(w, r) for w in ("loaded", "stopping") for r in (0, 1)]
    # FSDP2 splits every tensor along dim 0; an odd row count gives one shard a row more.
    for mine, total in shares.values():
        assert abs(mine - total / 2) <= 0.01 * total, shares


def test_shard_group_size_one_replicates_the_whole_base_on_each_rank(tmp_path, tiny_cache):
    server = start_server(tmp_path / "data", "--nproc-per-node", "2",
                          "--shard-group-size", "1")
    loss = _one_step(server.address)
    assert server.stop() == 0, server.log()[-3000:]
    assert np.isfinite(loss)
    shares = _shares(server.log())
    assert len(shares) == 4 and all(mine == total for mine, total in shares.values()), shares


def test_a_shard_group_size_that_does_not_divide_the_ranks_is_refused(tmp_path, tiny_cache):
    with pytest.raises(RuntimeError, match="--shard-group-size: 3 does not divide the 2 ranks"):
        start_server(tmp_path / "data", "--nproc-per-node", "2", "--shard-group-size", "3")


@pytest.mark.long
def test_a_hung_rank_is_given_up_within_the_collective_timeout(tmp_path, tiny_cache):
    server = start_server(tmp_path / "data", "--nproc-per-node", "2",
                          "--collective-timeout", str(TIMEOUT_S))
    service = ServiceClient(base_url=f"http://{server.address}")
    hung = None
    try:
        training = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        training.forward_backward(sft_data(n=2, seed=1), "cross_entropy").result()
        hung = _rank_pid(server.proc.pid, 1)
        os.kill(hung, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(tinker.APIConnectionError, match="rank 1 stopped"):
            training.forward_backward(sft_data(n=2, seed=1), "cross_entropy").result()
        # The collective's timeout, then three heartbeats to see which rank stopped.
        assert time.monotonic() - started < TIMEOUT_S + 3 + 5
        os.kill(hung, signal.SIGCONT)
        assert server.proc.wait(60) != 0
    finally:
        service.close()
        if hung is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)
        if server.proc.poll() is None:
            server.proc.kill()


@pytest.mark.long
def test_two_nodes_meet_at_the_rendezvous_and_serve_as_one(tmp_path, tiny_cache):
    # Two launchers on this machine play two nodes of one rank each.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    nodes, logs = [], []
    try:
        for node in (0, 1):
            logs.append(tmp_path / f"node{node}.log")
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "twinkle_server.cli", "serve", "--port", "0",
                 "--data-dir", str(tmp_path / f"data{node}"), "--nproc-per-node", "1",
                 "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", endpoint],
                stdout=logs[-1].open("w"), stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}))
        address = None
        deadline = time.monotonic() + 120
        while address is None and time.monotonic() < deadline:
            assert all(p.poll() is None for p in nodes), [f.read_text() for f in logs]
            found = [re.search(r"^listening on (\S+)$", f.read_text(), re.M) for f in logs]
            address = next((m.group(1) for m in found if m), None)
            time.sleep(0.2)
        assert address is not None, [f.read_text() for f in logs]
        assert np.isfinite(_one_step(address))
        text = "".join(f.read_text() for f in logs)
        assert sorted(_shares(text)) == [("loaded", 0), ("loaded", 1)]
    finally:
        for proc in nodes:
            proc.send_signal(signal.SIGTERM)
        codes = [proc.wait(60) for proc in nodes]
    assert codes == [0, 0], [f.read_text()[-2000:] for f in logs]


def test_a_configuration_that_cannot_serve_ends_every_rank_at_once(tmp_path, tiny_cache):
    # Rank 0 finds it (no API keys, a non-loopback host) and tells the others, which
    # would otherwise wait for it in a collective until the timeout.
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no API keys exist"):
        start_server(tmp_path / "data", "--nproc-per-node", "2", "--host", "0.0.0.0")
    assert time.monotonic() - started < 60


def _local_attention_copy(tiny_cache, tmp_path: Path) -> Path:
    """The tiny model with its first layer's kind set to chunked (local) attention, chunks
    of 8: a layer kind the decode pool does not hold (full and sliding-window attention
    and recurrent states it does). Refused from its config, before any forward (Qwen3's
    code would not run that kind)."""
    import json
    import shutil

    from twinkle_server.engine.tiny_model import build_tiny_model

    model_dir = shutil.copytree(build_tiny_model(tiny_cache), tmp_path / "chunked")
    config = json.loads((model_dir / "config.json").read_text())
    config.update(layer_types=["chunked_attention"] + ["full_attention"] * (
        config["num_hidden_layers"] - 1), attention_chunk_size=8)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def test_a_model_the_decode_pool_cannot_hold_is_refused_at_start_naming_the_cure(
        tmp_path, tiny_cache):
    """A sliding-window layer once crashed the continuous sampler mid-generation with a
    size mismatch (the pool holds windows now); a layer kind it does not hold is refused
    at start, from its config before its weights load, naming --sampler static."""
    model_dir = _local_attention_copy(tiny_cache, tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "twinkle_server.cli", "serve", "--model", str(model_dir),
         "--data-dir", str(tmp_path / "data"), "--port", "0", "--http-port", "0"],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "0: chunked_attention" in run.stderr and "--sampler static" in run.stderr


def test_a_split_models_trainer_ranks_refuse_a_model_the_sampler_ranks_pool_cannot_hold(
        tmp_path, tiny_cache):
    """Trainer ranks hold no decode pool, but rank 0 (a trainer) starts first and is what
    refuses a model its sampler ranks could not sample, naming the cure."""
    from twinkle_server.config.flags import ServerConfig
    from twinkle_server.engine.errors import InvalidArgument
    from twinkle_server.engine.parallel import OneRank
    from twinkle_server.ranks.launch import load_engine

    model_dir = _local_attention_copy(tiny_cache, tmp_path)
    config = ServerConfig(model=str(model_dir), sampler_ranks=1, data_dir=tmp_path)
    with pytest.raises(InvalidArgument, match="chunked_attention.*--sampler static"):
        load_engine(config, config.model_configs()[0], OneRank())


SPLIT_MODELS = """
[[models]]
name = "tiny"

[[models]]
name = "teacher"
path = "tiny-large"
role = "sample"
ranks = [0]
"""


def test_two_models_on_two_ranks_each_on_its_own_ranks(tmp_path, tiny_cache):
    """The student is sharded over both ranks, the teacher held by rank 0 alone, each
    with its own process groups: the student's loss and the teacher's logprobs equal a
    one-process server's (float32 rounding: the student's passes are split over ranks),
    and each rank logs the shares it holds."""
    models = tmp_path / "models.toml"
    models.write_text(SPLIT_MODELS)
    prompt = types.ModelInput.from_ints([5, 17, 29, 3, 88, 41])

    def run(*flags: str) -> tuple[float, list[float], str]:
        server = start_server(tmp_path / f"data{len(flags)}", "--models", str(models), *flags)
        service = ServiceClient(base_url=f"http://{server.address}")
        try:
            loss = _one_step(server.address)
            teacher = service.create_sampling_client(base_model="teacher").result()
            logprobs = teacher.compute_logprobs(prompt).result()[1:]
        finally:
            service.close()
        assert server.stop() == 0, server.log()[-3000:]
        return loss, logprobs, server.log()

    loss, logprobs, log = run("--nproc-per-node", "2")
    alone_loss, alone_logprobs, _ = run()
    assert loss == pytest.approx(alone_loss, rel=LOSS_RTOL)
    np.testing.assert_allclose(logprobs, alone_logprobs, atol=LOGPROB_ATOL, rtol=0)
    held = re.findall(r"(loaded|stopping): rank (\d) of (\d) holds", log)
    # The student: rank 0 and 1 of 2; the teacher: rank 0 of 1.
    assert sorted(held) == sorted((when, rank, world) for when in ("loaded", "stopping")
                                  for rank, world in (("0", "2"), ("1", "2"), ("0", "1"))), held

