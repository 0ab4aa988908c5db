"""The shared connection against a real server: URLs, keys, sessions, ordered ops, errors."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

import twinkle_wire as wire
from twinkle_client import api, errors
from twinkle_client.api import write_files
from twinkle_client.connection import Connection, parse_base_url, setting
from twinkle_client.tokenizer import load_tokenizer, served_name
from twinkle_server.process import start_server
from twinkle_wire._proto.twinkle.v1 import common_pb2, training_pb2

from ..numerics import LOSS_RTOL


@pytest.mark.parametrize("url, expected", [
    ("http://127.0.0.1:8000", ("127.0.0.1:8000", False)),
    ("https://train.example.com:8443/", ("train.example.com:8443", True)),
    ("https://train.example.com", ("train.example.com:443", True)),
    ("127.0.0.1:9000", ("127.0.0.1:9000", False)),
    ("http://[::1]:7000", ("[::1]:7000", False)),
])
def test_base_url_scheme_chooses_plaintext_or_tls(url, expected):
    assert parse_base_url(url) == expected


@pytest.mark.parametrize("url, message", [("", "empty"), ("ftp://host:1", "scheme"),
                                          ("http://:80", "no host")])
def test_bad_base_url_names_the_field(url, message):
    with pytest.raises(ValueError, match=f"base_url: .*{message}|base_url: {message}"):
        parse_base_url(url)


def test_setting_prefers_the_argument_then_env_names_in_order(monkeypatch):
    monkeypatch.setenv("FIRST_URL", "")
    monkeypatch.setenv("SECOND_URL", "b:2")
    assert setting("a:1", "FIRST_URL", "SECOND_URL") == "a:1"
    assert setting(None, "FIRST_URL", "SECOND_URL") == "b:2"
    assert setting(None, "MISSING_URL") is None


def test_download_refuses_a_file_name_that_leaves_the_directory(tmp_path):
    chunks = iter([common_pb2.FileChunk(path="../escape", data=b"x", total_size=1, last=True)])
    with pytest.raises(errors.InvalidArgumentError, match="unsafe file name"):
        write_files(chunks, tmp_path / "dest")
    assert not (tmp_path / "escape").exists()
    assert not (tmp_path / "dest").exists()


def test_hub_prefixes_are_stripped_from_served_names():
    assert served_name("ms://Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert served_name("hf://tiny") == "tiny"
    assert served_name("tiny") == "tiny"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, tiny_cache):
    data_dir = tmp_path_factory.mktemp("keyed")
    keys = {}
    for tenant in ("alice", "bob"):
        out = subprocess.run([sys.executable, "-m", "twinkle_server.cli", "keys", "create",
                              "--tenant", tenant, "--data-dir", str(data_dir)],
                             capture_output=True, text=True, check=True, timeout=120)
        keys[tenant] = out.stdout.strip().splitlines()[-1]
    proc = start_server(data_dir)
    yield proc, keys
    proc.stop()


def _datums(n: int = 2, length: int = 8) -> list[wire.Datum]:
    rng = np.random.default_rng(0)
    return [wire.encode_datum(rng.integers(3, 200, length),
                              {"target_tokens": rng.integers(3, 200, length),
                               "weights": np.ones(length, np.float32)}, i) for i in range(n)]


CE = api.Loss("cross_entropy")


def _new_model(conn: Connection) -> str:
    lora = api.LoraSpec(rank=4, seed=0, train_mlp=True, train_attn=True)
    return api.create_model(lora=lora).send(conn).model_id


@pytest.mark.integration
def test_missing_or_wrong_key_is_an_authentication_error(keyed_server):
    proc, _ = keyed_server
    with pytest.raises(errors.AuthenticationError, match="authorization"):
        Connection(f"http://{proc.address}", "not-a-key", client_name="test")


@pytest.mark.integration
def test_ops_submitted_from_threads_run_in_call_order(keyed_server):
    proc, keys = keyed_server
    with Connection(proc.address, keys["alice"], client_name="test") as conn:
        model = _new_model(conn)
        futures = []
        lock = threading.Lock()

        def submit(k: int) -> None:
            call = api.forward(_datums(), CE)
            with lock:  # reservation and submission together: the call order is the seq order
                op = conn.reserve(model)
                futures.append((op.seq_id, conn.submit(call.send, conn, op)))

        threads = [threading.Thread(target=submit, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = {seq: fut.result(timeout=120) for seq, fut in futures}
        assert sorted(results) == list(range(6))
        # No optimizer step between them: every forward_backward sees the same weights, so
        # the same loss (to LOSS_RTOL: rounding to 4 places can split two equal-but-for-
        # rounding losses across a digit).
        losses = [r.loss for r in results.values()]
        assert max(losses) - min(losses) <= LOSS_RTOL * abs(losses[0]), losses
        assert all(len(r.outputs) == 2 and r.outputs[0]["logprobs"].shape == (8,)
                   for r in results.values())


@pytest.mark.integration
def test_server_errors_become_typed_exceptions_with_the_servers_message(keyed_server):
    proc, keys = keyed_server
    with Connection(proc.address, keys["alice"], client_name="test") as alice, \
            Connection(proc.address, keys["bob"], client_name="test") as bob:
        model = _new_model(alice)
        with pytest.raises(errors.InvalidArgumentError, match="unknown loss 'nope'"):
            api.forward(_datums(), api.Loss("nope")).send(alice, alice.reserve(model))
        with pytest.raises(errors.NotFoundError, match="run_id: no run"):
            api.get_run(model).send(bob)
        bob.register_model(model, 0)
        with pytest.raises(errors.NotFoundError, match="model_id"):
            api.forward(_datums(), CE).send(bob, bob.reserve(model))
        # The failed op took its seq id; the model's next op still runs.
        result = api.forward(_datums(), CE).send(alice, alice.reserve(model))
        assert np.isfinite(result.loss)


@pytest.mark.integration
def test_closing_the_connection_unloads_its_models_and_later_calls_fail(keyed_server):
    proc, keys = keyed_server
    conn = Connection(proc.address, keys["alice"], client_name="test")
    model = _new_model(conn)
    conn.close()
    with Connection(proc.address, keys["alice"], client_name="test") as other:
        with pytest.raises(errors.NotFoundError):
            other.call(other.training.GetInfo, training_pb2.GetInfoRequest(model_id=model))
        run = api.get_run(model).send(other)
        assert not run.loaded
    with pytest.raises(errors.FailedPreconditionError, match="closed"):
        conn.submit(lambda: None)


@pytest.mark.integration
def test_tokenizer_comes_from_the_server_and_refuses_unserved_names(keyed_server,
                                                                    monkeypatch):
    proc, keys = keyed_server
    for name in ("TWINKLE_BASE_URL", "TINKER_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    with Connection(proc.address, keys["bob"], client_name="test") as conn:
        tokenizer = load_tokenizer("ms://tiny", conn)
        assert tokenizer.decode(tokenizer("hello world")["input_ids"]) == "hello world"
        with pytest.raises(errors.InvalidArgumentError, match="not served"):
            load_tokenizer("ms://Qwen/Qwen3.5-4B", conn)
    with pytest.raises(ValueError, match="no Twinkle server is connected"):
        load_tokenizer("some/model-id")


@pytest.mark.integration
def test_forward_refuses_unpacked_datums_and_releases_the_seq_id_it_was_given(keyed_server):
    proc, keys = keyed_server
    with Connection(proc.address, keys["alice"], client_name="test") as conn:
        model = _new_model(conn)
        op = conn.reserve(model)
        with pytest.raises(TypeError, match=r"chunks: expected the ForwardChunk messages of "
                                            r"wire.pack_request"):
            api.ForwardCall(_datums(), CE)
        with pytest.raises(TypeError, match=r"datums: expected a list of wire.Datum"):
            api.forward(wire.pack_request(_datums()), CE)
        api.release(conn, op)  # SkipSeq: the op that was never sent gives its seq_id back
        result = api.submit(conn, model, api.forward(_datums(), CE)).result(timeout=60)
        assert np.isfinite(result.loss)
