"""How long ephemeral sampler weights live (issue 31, 1), through the stock SDK over HTTP
on a server with a 2 s `--session-timeout`: a sampling client of
`save_weights_and_get_sampling_client()` held but unused for twice the timeout still
samples while its session heart-beats (tinker-cookbook's `train_dpo.py` makes its
reference once and reads it every step, however long a step takes); an RL loop that
snapshots every step keeps its first and newest snapshots on disk, not one a step; and an
expired session's unloads and ends are in the audit log."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import tinker
from tinker import types

from twinkle_server.process import start_server

from ..audit_days import entries_since_yesterday
from ..service.harness import create_key
from .conftest import sft_data

pytestmark = pytest.mark.integration
TIMEOUT_S = 2
"""The server's `--session-timeout`: the SDK heart-beats every 10 s, so the test beats
for its sessions (`beating`), every `BEAT_S`."""
BEAT_S = 0.3
IDLE_S = 2 * TIMEOUT_S + 1.5
"""Twice the timeout, and more than one expiry sweep (1 s) after it."""
PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)


@pytest.fixture(scope="module")
def short(tmp_path_factory, tiny_cache):
    data_dir = tmp_path_factory.mktemp("short-timeout")
    key = create_key(data_dir, "carol")
    proc = start_server(data_dir, "--session-timeout", str(TIMEOUT_S), http=True)
    proc.key = key
    yield proc
    proc.stop()


def _client(server) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=f"http://{server.http_address}", api_key=server.key)


class beating:
    """Heart-beat the client's session every `BEAT_S` while in the block."""

    def __init__(self, server, client: tinker.ServiceClient) -> None:
        self.url = f"http://{server.http_address}/api/v1/session_heartbeat"
        self.body = {"session_id": client.holder.get_session_id()}
        self.headers = {"X-API-Key": server.key}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=5) as http:
            while not self.stop.wait(BEAT_S):
                http.post(self.url, json=self.body, headers=self.headers).raise_for_status()

    def __enter__(self) -> beating:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _train(tc: tinker.TrainingClient) -> None:
    tc.forward_backward(sft_data(n=2), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def _on_disk(server, ids: Iterator[str]) -> set[str]:
    root = server.data_dir / "sampler-snapshots"
    return {i for i in ids if (root / i).is_dir()}


def test_a_held_reference_outlives_twice_the_timeout_and_an_rl_chain_stays_bounded(short):
    client = _client(short)
    try:
        with beating(short, client):
            tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
            reference = tc.save_weights_and_get_sampling_client().result()   # train_dpo's
            before = reference.compute_logprobs(PROMPT).result()
            base = client.create_sampling_client(base_model="tiny").result()
            _train(tc)
            chain = []
            for _ in range(3):   # RL steps (training left out): snapshot, sample it
                chain.append(tc.save_weights_and_get_sampling_client().result())
                chain[-1].sample(PROMPT, 1, GREEDY).result()
            ids = [s._sampling_session_id for s in (reference, *chain)]
            assert {ids[0], ids[-1]} <= _on_disk(short, ids)
            time.sleep(IDLE_S)   # nothing used; the session heart-beats
            # The snapshots the loop moved past go at the first sweep after that (a busy
            # machine may run it late: waited for, within 30 s, without using any).
            deadline = time.monotonic() + 30
            while _on_disk(short, ids) != {ids[0], ids[-1]} and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _on_disk(short, ids) == {ids[0], ids[-1]}
            # The reference samples what it sampled (the policy trained since), the
            # latest weights too. Exact: the same scoring pass of the same frozen weights,
            # the same shapes, alone.
            assert reference.compute_logprobs(PROMPT).result() == before
            assert len(chain[-1].sample(PROMPT, 1, GREEDY).result().sequences) == 1
            assert len(base.sample(PROMPT, 1, GREEDY).result().sequences) == 1
            assert _on_disk(short, ids) == {ids[0], ids[-1]}
            with pytest.raises(tinker.NotFoundError, match="no sampling session"):
                chain[0].sample(PROMPT, 1, GREEDY).result()
            _train(tc)   # the session and its model lived on
    finally:
        client.close("success").result()
    assert _on_disk(short, ids) == set()   # and went with the session


def test_an_expired_sessions_unloads_and_ends_are_in_the_audit_log(short):
    """The expiry sweep writes the session's close, its model's unload and its sampler's
    end one after another, not at once: the test reads the audit log until all three
    are there (within `10 * TIMEOUT_S`), not only the first it sees. It once stopped at
    `session_close` and, in a busy run, found no `model_unload` yet."""
    client = _client(short)   # the SDK beats every 10 s: the session expires first
    # Beaten while the model and its snapshot are made: on a busy machine they took longer
    # than the 2 s timeout, and the session expired before the snapshot ("was closed").
    with beating(short, client):
        tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=4).result()
        snapshot = tc.save_weights_and_get_sampling_client().result()
    session_id = client.holder.get_session_id()
    admin = tinker.AdminClient(base_url=f"http://{short.http_address}", api_key=short.key)

    def mine(entries):
        """This session's close, its model's unloads and its snapshot's ends."""
        return {
            "session_close": [e for e in entries if e.event == "session_close"
                              and e.event_details["session_id"] == session_id],
            "model_unload": [e for e in entries if e.event == "model_unload"
                             and e.event_details["model_id"] == tc.model_id],
            "sampler_end": [e for e in entries if e.event == "sampler_end"
                            and e.event_details["sampling_session_id"]
                            == snapshot._sampling_session_id]}

    deadline = time.monotonic() + 10 * TIMEOUT_S
    while True:
        entries = entries_since_yesterday(admin)
        found = mine(entries)
        if all(found.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(found.values()), {event: len(rows) for event, rows in found.items()}
    assert [e.event_details["reason"] for e in found["session_close"]] == ["expired"]
    [unload] = found["model_unload"]
    assert unload.event_details["reason"] == "session expired"
    [end] = found["sampler_end"]
    assert end.event_details["reason"] == "session expired"
    assert all(e.event_details["actor"] == "carol" for e in entries)
