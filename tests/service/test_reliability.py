"""Load, crash and expiry behaviour of a real server process."""

from __future__ import annotations

import signal
import sqlite3
import threading
import time

import grpc
import pytest
from safetensors.numpy import load_file

from twinkle_wire._proto.twinkle.v1 import common_pb2, runs_pb2, session_pb2, training_pb2

from ..numerics import assert_trained_alike
from .harness import Client, start_server, toy_datums, twinkle_server

pytestmark = pytest.mark.integration
STEPS = 20


def _weights(client, path, dest):
    return load_file(str(client.download(path, dest) / "adapter_model.safetensors"))


def test_sixteen_threads_on_four_tenants_pipelined_equal_each_sequential_reference(
        tmp_path, tiny_cache):
    data_dir = tmp_path / "load"
    keys = [twinkle_server("keys", "create", "--tenant", f"t{i}", "--data-dir",
                           str(data_dir)).stdout.strip().splitlines()[-1] for i in range(4)]
    proc = start_server(data_dir)
    try:
        clients = [Client(proc.address, key) for key in keys]
        models = [c.create_model(seed=10 + i) for i, c in enumerate(clients)]
        references = [c.create_model(seed=10 + i) for i, c in enumerate(clients)]
        data = [toy_datums(2, seed=i) for i in range(4)]
        errors: list[BaseException] = []

        def worker(tenant: int, lane: int) -> None:
            client = Client(proc.address, keys[tenant])
            try:
                for seq in range(lane, 2 * STEPS, 4):
                    if seq % 2 == 0:
                        client.forward_backward(models[tenant], data[tenant], seq=seq)
                    else:
                        client.optim_step(models[tenant], seq=seq)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t, lane))
                   for t in range(4) for lane in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for i, client in enumerate(clients):
            for _ in range(STEPS):
                client.forward_backward(references[i], data[i])
                client.optim_step(references[i])
            client.seq[models[i]] = 2 * STEPS
            got = _weights(client, client.save(models[i], "load", optimizer=False).path,
                           tmp_path / f"m{i}")
            want = _weights(client, client.save(references[i], "ref", optimizer=False).path,
                            tmp_path / f"r{i}")
            # Pipelined passes merge the tenants' rows (shapes that depend on timing), the
            # references run alone: a rounding apart, which Adam turns into weight drift.
            assert_trained_alike(got, want, learning_rate=1e-2, steps=STEPS)
    finally:
        proc.stop()


def test_kill_9_during_saves_leaves_only_complete_checkpoints_and_restarts(
        tmp_path, tiny_cache):
    data_dir = tmp_path / "crash"
    proc = start_server(data_dir)
    client = Client(proc.address)
    model = client.create_model(rank=32, seed=1)
    client.forward_backward(model, toy_datums(2))
    client.optim_step(model)
    reported: list[str] = []

    def save_loop() -> None:
        for i in range(200):
            try:
                reported.append(client.save(model, f"c{i}").path)
            except grpc.RpcError:
                return

    saver = threading.Thread(target=save_loop)
    saver.start()
    # Killed mid-loop once a few saves are reported (a fixed 1.5 s once stood for this).
    deadline = time.monotonic() + 60
    while len(reported) < 3:
        assert time.monotonic() < deadline and saver.is_alive(), "the saves never finished"
        time.sleep(0.01)
    proc.stop(signal.SIGKILL)
    saver.join()
    assert reported

    proc = start_server(data_dir)
    try:
        client = Client(proc.address)
        listed = client.call(client.runs.ListCheckpoints, runs_pb2.ListCheckpointsRequest())
        paths = {c.path for c in listed.checkpoints}
        assert set(reported) <= paths
        for checkpoint in listed.checkpoints:
            folder = client.download(checkpoint.path, tmp_path / checkpoint.name)
            assert (folder / "adapter_config.json").is_file()
            assert load_file(str(folder / "adapter_model.safetensors"))
        with sqlite3.connect(data_dir / "twinkle.db") as db:
            assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        resumed = client.create_model(from_checkpoint=reported[-1], load_optimizer=True)
        client.forward_backward(resumed, toy_datums(2))
    finally:
        proc.stop()


def test_idle_session_is_unloaded_its_slot_freed_and_checkpoints_stay(tmp_path, tiny_cache):
    proc = start_server(tmp_path / "idle", "--session-timeout", "2", "--max-adapters", "1")
    try:
        client = Client(proc.address)
        session = client.call(client.session.CreateSession, session_pb2.CreateSessionRequest())
        model = client.create_model(session_id=session.session_id)
        saved = client.save(model, "kept")
        time.sleep(2)   # the session timeout; an expiry sweep (every second) then finds it
        # Polled (only a heartbeat keeps a session alive) until unloaded and its slot free,
        # within 60 s: a busy machine may run the sweep late.
        deadline = time.monotonic() + 60
        while True:
            try:
                client.call(client.training.GetInfo, training_pb2.GetInfoRequest(model_id=model))
                gone = None
            except grpc.RpcError as exc:
                gone = exc
            caps = client.call(client.session.GetServerCapabilities, common_pb2.Empty())
            if (gone is not None and caps.adapters_loaded == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert gone is not None and gone.code() == grpc.StatusCode.NOT_FOUND, gone
        assert caps.adapters_loaded == 0
        again = client.create_model(from_checkpoint=saved.path, load_optimizer=True)
        assert again != model
    finally:
        proc.stop()
