"""The real server process on loopback: the whole train/save/restart path, ordering,
auth and tenant isolation, and validation that never disturbs the next request."""

from __future__ import annotations

import signal
import threading

import grpc
import numpy as np
import pytest
from safetensors.numpy import load_file

import twinkle_wire as wire
from twinkle_wire._proto.twinkle.v1 import common_pb2, runs_pb2, sampling_pb2, training_pb2

from .harness import Client, send_batch, start_server, toy_datums, twinkle_server

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_cache):
    proc = start_server(tmp_path_factory.mktemp("open-server"), "--max-seq-len", "64",
                        "--max-batch-tokens", "2000", "--max-rank", "32")
    yield proc
    proc.stop()


def _weights(client, path, dest):
    folder = client.download(path, dest)
    return load_file(str(folder / "adapter_model.safetensors"))


def test_train_save_list_download_then_restart_and_resume_matches_uninterrupted(
        tmp_path, tiny_cache):
    data = toy_datums()
    proc = start_server(tmp_path / "data")
    client = Client(proc.address)
    straight = client.create_model(seed=3)
    first = client.create_model(seed=3)
    for _ in range(4):
        client.forward_backward(straight, data)
        client.optim_step(straight)
    for _ in range(2):
        client.forward_backward(first, data)
        client.optim_step(first)
    saved = client.save(first, "half")
    assert saved.path == f"twinkle://{first}/weights/half"
    end = client.save(straight, "end")
    listed = client.call(client.runs.ListCheckpoints, runs_pb2.ListCheckpointsRequest())
    assert {c.path for c in listed.checkpoints} == {saved.path, end.path}
    expected = _weights(client, end.path, tmp_path / "end")
    assert proc.stop(signal.SIGTERM) == 0

    proc = start_server(tmp_path / "data")
    client = Client(proc.address)
    runs = client.call(client.runs.ListRuns, runs_pb2.ListRunsRequest())
    assert {r.run_id for r in runs.runs} == {straight, first}
    resumed = client.create_model(from_checkpoint=saved.path, load_optimizer=True)
    for _ in range(2):
        client.forward_backward(resumed, data)
        client.optim_step(resumed)
    final = client.save(resumed, "final")
    got = _weights(client, final.path, tmp_path / "final")
    assert set(got) == set(expected)
    assert max(float(np.abs(got[k] - expected[k]).max()) for k in got) <= 1e-6
    proc.stop()


def test_ops_sent_out_of_order_from_threads_run_in_seq_order_and_retries_do_not_rerun(server):
    client = Client(server.address)
    data = toy_datums(2)
    model = client.create_model(seed=1)
    reference = client.create_model(seed=1)
    for _ in range(3):
        client.forward_backward(reference, data)
        client.optim_step(reference)
    results = {}

    def send(seq):
        if seq % 2 == 0:
            results[seq] = client.forward_backward(model, data, seq=seq)[1]
        else:
            results[seq] = client.optim_step(model, seq=seq)

    threads = [threading.Thread(target=send, args=(s,)) for s in (5, 3, 4, 1, 2, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    retried = client.optim_step(model, seq=5)
    client.seq[model] = 6
    assert retried.metrics["step"] == results[5].metrics["step"] == 3.0
    info = client.call(client.training.GetInfo, training_pb2.GetInfoRequest(model_id=model))
    assert info.next_seq_id == 6
    a = client.save(model, "ordered", optimizer=False)
    b = client.save(reference, "sequential", optimizer=False)
    tmp = server.data_dir / "dl"
    wa, wb = _weights(client, a.path, tmp / "a"), _weights(client, b.path, tmp / "b")
    # Exact: both models ran the same passes alone, in one server process (nothing else
    # was queued to merge with); only the arrival order of the ops differed.
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)


def _code(fn):
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


def _mismatched(ids) -> common_pb2.DatumBatch:
    """A batch whose target_tokens are shorter than its input (built past the client check)."""
    batch = wire.pack_datums([wire.encode_datum(ids, {})])
    batch.loss_inputs["target_tokens"].CopyFrom(wire.encode_array(ids[:3]))
    return batch


def test_every_validation_case_returns_its_code_and_the_server_keeps_serving(server):
    client = Client(server.address)
    model = client.create_model(seed=2)
    ids = np.arange(5, 15)
    good = (ids, {"target_tokens": ids + 1, "weights": np.ones(10, np.float32)})
    cases = [
        # First: once a forward_backward has failed beside others that trained, the next
        # step is refused for that (scheduling/executor.py) before its own arguments.
        (lambda: client.call(client.training.OptimStep, training_pb2.OptimStepRequest(
            op=client.header(model), adam=training_pb2.AdamParams(learning_rate=float("nan")))),
         grpc.StatusCode.INVALID_ARGUMENT, "learning_rate: must be finite"),
        (lambda: client.forward_backward(model, [(np.array([1, 10**7]), {
            "target_tokens": np.array([1, 2])})]), grpc.StatusCode.INVALID_ARGUMENT,
         "outside the vocabulary"),
        (lambda: send_batch(client.training.ForwardBackward, client.header(model),
                            _mismatched(ids), client.metadata),
         grpc.StatusCode.INVALID_ARGUMENT, "first dimension is 3 but input_ids has 10"),
        (lambda: client.forward_backward(model, []), grpc.StatusCode.INVALID_ARGUMENT,
         "batch is empty"),
        (lambda: client.forward_backward(model, [(np.zeros(80, np.int64), {
            "target_tokens": np.zeros(80, np.int64)})]), grpc.StatusCode.INVALID_ARGUMENT,
         "80 tokens is over the 64-token limit"),
        (lambda: client.forward_backward(model, [good] * 210), grpc.StatusCode.INVALID_ARGUMENT,
         "more than 2000 tokens"),
        (lambda: client.forward_backward(model, [good], loss="hinge"),
         grpc.StatusCode.INVALID_ARGUMENT, "unknown loss 'hinge'"),
        (lambda: client.create_model(rank=64), grpc.StatusCode.INVALID_ARGUMENT,
         r"lora.rank: 64 is outside [1, 32]"),
        (lambda: client.call(client.training.CreateModel, training_pb2.CreateModelRequest(
            base_model="Qwen/NotServed", lora=common_pb2.LoraConfig(rank=4, train_mlp=True))),
         grpc.StatusCode.INVALID_ARGUMENT, "'Qwen/NotServed' is not served here"),
        (lambda: client.call(client.training.SetOptimizer, training_pb2.ConfigureRequest(
            op=client.header(model), name="Lion")), grpc.StatusCode.INVALID_ARGUMENT,
         "'Lion' is not allowed"),
        (lambda: client.save(model, "../escape"), grpc.StatusCode.INVALID_ARGUMENT,
         "not a valid checkpoint name"),
        (lambda: client.save(model, "a/b"), grpc.StatusCode.INVALID_ARGUMENT,
         "not a valid checkpoint name"),
        (lambda: client.save(model, "bad\x07name"), grpc.StatusCode.INVALID_ARGUMENT,
         "not a valid checkpoint name"),
        (lambda: client.call(client.training.GetInfo, training_pb2.GetInfoRequest(
            model_id="run-nope")), grpc.StatusCode.NOT_FOUND, "no model 'run-nope'"),
    ]
    for call, code, message in cases:
        got_code, details = _code(call)
        assert got_code == code, (message, details)
        assert message in details, details
        outputs, last = client.forward_backward(model, [good])
        assert outputs[0].shape == (10,) and last.metrics["loss:sum"] > 0


def test_past_the_resident_slots_a_model_pages_the_idle_one_out_and_both_train(
        tmp_path, tiny_cache):
    """`--max-adapters 1`: a second model is created, not refused; the two train in turn,
    each paging the other out (engine/test_residency.py shows that is exact)."""
    proc = start_server(tmp_path / "small", "--max-adapters", "1")
    client = Client(proc.address)
    models = [client.create_model(seed=1), client.create_model(seed=2)]
    for _ in range(2):
        for model in models:
            client.forward_backward(model, toy_datums(2))
            client.optim_step(model)
    proc.stop()


def test_sampling_from_a_saved_sampler_checkpoint_and_the_base(server):
    client = Client(server.address)
    model = client.create_model(seed=4)
    client.forward_backward(model, toy_datums(2))
    client.optim_step(model)
    saved = client.save(model, "for-sampling", sampler=True)
    assert saved.path == f"twinkle://{model}/sampler_weights/for-sampling"
    prompt = wire.encode_array(np.array([5, 6, 7], np.int64))
    params = sampling_pb2.SamplingParams(max_tokens=5, temperature=1.0, top_p=1.0, seed=9)
    for kw in ({"model_path": saved.path}, {"base_model": "tiny"}):
        # Each sample the first of its own sampling session, alone: nothing cached, the
        # same shapes and code, so the same tokens exactly. (In one session the second
        # would reuse the first's prompt KV, a rounding apart: tokens up to a near tie.)
        replies = []
        for _ in range(2):
            session = client.call(client.sampling.CreateSamplingSession,
                                  sampling_pb2.CreateSamplingSessionRequest(**kw))
            replies.append(client.call(client.sampling.Sample, sampling_pb2.SampleRequest(
                sampling_session_id=session.sampling_session_id, prompt=prompt,
                num_samples=3, params=params, include_prompt_logprobs=True)))
        one, two = replies
        assert len(one.sequences) == 3
        for a, b in zip(one.sequences, two.sequences, strict=True):
            assert wire.decode_array(a.tokens).tolist() == wire.decode_array(b.tokens).tolist()
            assert wire.decode_array(a.logprobs).shape == wire.decode_array(a.tokens).shape
        assert np.isnan(wire.decode_array(one.prompt_logprobs)[0])
    # max_tokens 0 (Tinker's None) runs to the context limit: 64 - 3 prompt tokens.
    unbounded = client.call(client.sampling.Sample, sampling_pb2.SampleRequest(
        sampling_session_id=session.sampling_session_id, prompt=prompt, num_samples=1,
        params=sampling_pb2.SamplingParams(temperature=1.0, seed=9, ignore_eos=True)))
    assert wire.decode_array(unbounded.sequences[0].tokens).size == 61
    assert unbounded.sequences[0].stop_reason == "length"


def test_auth_wrong_key_and_tenant_isolation(tmp_path, tiny_cache):
    data_dir = tmp_path / "keyed"
    keys = {}
    for tenant in ("alice", "bob"):
        out = twinkle_server("keys", "create", "--tenant", tenant, "--data-dir", str(data_dir))
        assert out.returncode == 0, out.stderr
        keys[tenant] = out.stdout.strip().splitlines()[-1]
    listing = twinkle_server("keys", "list", "--data-dir", str(data_dir)).stdout
    assert "alice" in listing and keys["alice"] not in listing
    proc = start_server(data_dir)
    try:
        stranger = Client(proc.address, "tw-not-a-key")
        code, _ = _code(lambda: stranger.create_model())
        assert code == grpc.StatusCode.UNAUTHENTICATED
        alice, bob = Client(proc.address, keys["alice"]), Client(proc.address, keys["bob"])
        model = alice.create_model()
        alice.forward_backward(model, toy_datums(1))
        saved = alice.save(model, "mine")
        sampler = alice.save(model, "mine-s", sampler=True)
        attempts = [
            lambda: bob.call(bob.training.GetInfo, training_pb2.GetInfoRequest(model_id=model)),
            lambda: bob.forward_backward(model, toy_datums(1), seq=0),
            lambda: bob.call(bob.runs.GetRun, runs_pb2.GetRunRequest(run_id=model)),
            lambda: bob.call(bob.runs.GetCheckpoint, runs_pb2.CheckpointRef(path=saved.path)),
            lambda: bob.download(saved.path, tmp_path / "stolen"),
            lambda: bob.call(bob.runs.DeleteCheckpoint, runs_pb2.CheckpointRef(path=saved.path)),
            lambda: bob.create_model(from_checkpoint=saved.path),
            lambda: bob.call(bob.sampling.CreateSamplingSession,
                             sampling_pb2.CreateSamplingSessionRequest(model_path=sampler.path)),
            lambda: bob.call(bob.training.LoadState, training_pb2.LoadStateRequest(
                op=bob.header(bob.create_model()), path=saved.path)),
        ]
        for attempt in attempts:
            code, details = _code(attempt)
            assert code == grpc.StatusCode.NOT_FOUND, details
        assert bob.call(bob.runs.ListRuns, runs_pb2.ListRunsRequest()).total == 1
        assert alice.call(alice.runs.GetCheckpoint,
                          runs_pb2.CheckpointRef(path=saved.path)).name == "mine"
        assert keys["alice"] not in proc.log() and keys["bob"] not in proc.log()
    finally:
        proc.stop()


def test_non_loopback_bind_without_keys_refuses_to_start(tmp_path):
    out = twinkle_server("serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path / "d"))
    assert out.returncode == 2
    assert "no API keys exist" in out.stderr
