"""Security of a keyed server: every RPC is tenant-isolated, keys never leave the hash,
TLS works end to end, and per-tenant limits hold one tenant back without touching another.

The isolation test enumerates the RPCs from the service descriptors: an RPC added to the
contract without a case here fails the test until someone decides how it is isolated.
"""

from __future__ import annotations

import datetime
import ipaddress
import sqlite3
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest

import twinkle_wire as wire
from twinkle_client import errors
from twinkle_server.process import start_server
from twinkle_server.server import SERVICES
from twinkle_wire._proto.twinkle.v1 import (
    common_pb2,
    external_pb2,
    runs_pb2,
    sampling_pb2,
    session_pb2,
    training_pb2,
)

from ..audit_days import audit_days
from .harness import create_key, packed_datums, small_lora
from .transport import ProtoConnection as Connection
from .transport import Transport

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tenants(tmp_path_factory, tiny_cache):
    """A keyed server with alice's model, session, sampler and checkpoints, and bob."""
    data_dir = tmp_path_factory.mktemp("secure")
    keys = {t: create_key(data_dir, t) for t in ("alice", "bob")}
    proc = start_server(data_dir)
    alice = Connection(proc.address, keys["alice"], client_name="test")
    bob = Connection(proc.address, keys["bob"], client_name="test")
    model = alice.create_model(training_pb2.CreateModelRequest(lora=small_lora())).model_id
    alice.forward(alice.op(model), packed_datums(), common_pb2.LossFn(name="cross_entropy"))
    saved = alice.call(alice.training.SaveState, training_pb2.SaveRequest(
        op=alice.op(model), name="mine", include_optimizer=True)).path
    sampler_ckpt = alice.call(alice.training.SaveWeightsForSampler, training_pb2.SaveRequest(
        op=alice.op(model), name="mine-s")).path
    external = alice.call(alice.external.SaveWeightsExternal,
                          external_pb2.SaveWeightsExternalRequest(
                              op=alice.op(model), name="mine-x")).path
    sampler = alice.call(alice.sampling.CreateSamplingSession,
                         sampling_pb2.CreateSamplingSessionRequest(
                             model_path=sampler_ckpt)).sampling_session_id
    sampled = alice.call(alice.sampling.Sample, sampling_pb2.SampleRequest(
        sampling_session_id=sampler, prompt=wire.encode_array(np.array([5, 6, 7], np.int64)),
        num_samples=1, params=sampling_pb2.SamplingParams(max_tokens=3, temperature=1.0),
        record_stability_info=True)).sequences[0]
    bob_model = bob.create_model(training_pb2.CreateModelRequest(lora=small_lora())).model_id
    bob.register_model(model, 0)  # bob may guess alice's id; the server must still refuse
    objects = {"model": model, "saved": saved, "sampler_ckpt": sampler_ckpt, "external": external,
               "sampler": sampler, "session": alice.session_id, "bob_model": bob_model,
               "sequence": sampled.sequence_id,
               "sampled": wire.decode_array(sampled.tokens, "tokens").astype(np.int64)}
    yield proc, keys, alice, bob, objects
    alice.close()
    bob.close()
    proc.stop()


def _isolation_cases(bob: Connection, o: dict[str, str], tmp: Path
                     ) -> dict[str, Callable[[], object]]:
    """Bob's attempt at each RPC on alice's objects; every one must answer NOT_FOUND."""
    t, s, r = bob.training, bob.sampling, bob.runs
    m = o["model"]
    prompt = wire.encode_array(np.array([5, 6, 7], np.int64))

    def op(method, request_type, **fields):
        return lambda: bob.call(method, request_type(op=bob.op(m), **fields))

    return {
        "Heartbeat": lambda: bob.call(bob.session.Heartbeat,
                                      session_pb2.HeartbeatRequest(session_id=o["session"])),
        "CloseSession": lambda: bob.call(bob.session.CloseSession,
                                         session_pb2.CloseSessionRequest(session_id=o["session"])),
        "CreateModel": lambda: bob.call(t.CreateModel, training_pb2.CreateModelRequest(
            from_checkpoint=o["saved"]), retry=False),
        "GetInfo": lambda: bob.call(t.GetInfo, training_pb2.GetInfoRequest(model_id=m)),
        "UnloadModel": lambda: bob.call(t.UnloadModel, training_pb2.UnloadModelRequest(model_id=m)),
        "Forward": lambda: bob.forward(bob.op(m), packed_datums(), backward=False),
        "ForwardBackward": lambda: bob.forward(bob.op(m), packed_datums(),
                                               common_pb2.LossFn(name="cross_entropy")),
        "OptimStep": op(t.OptimStep, training_pb2.OptimStepRequest,
                        adam=training_pb2.AdamParams(learning_rate=1e-3)),
        "SetOptimizer": op(t.SetOptimizer, training_pb2.ConfigureRequest, name="AdamW"),
        "SetLrScheduler": op(t.SetLrScheduler, training_pb2.ConfigureRequest, name="LinearLR"),
        "SetLoss": op(t.SetLoss, training_pb2.SetLossRequest,
                      loss=common_pb2.LossFn(name="CrossEntropyLoss")),
        "ClipGradNorm": op(t.ClipGradNorm, training_pb2.ClipGradNormRequest, max_norm=1.0),
        "Step": op(t.Step, training_pb2.OpRequest),
        "ZeroGrad": op(t.ZeroGrad, training_pb2.OpRequest),
        "LrStep": op(t.LrStep, training_pb2.OpRequest),
        "CalculateMetric": op(t.CalculateMetric, training_pb2.CalculateMetricRequest),
        "GetTrainConfigs": op(t.GetTrainConfigs, training_pb2.OpRequest),
        "SkipSeq": op(t.SkipSeq, training_pb2.OpRequest),
        "SaveState": op(t.SaveState, training_pb2.SaveRequest, name="stolen"),
        "SaveWeightsForSampler": op(t.SaveWeightsForSampler, training_pb2.SaveRequest,
                                    name="stolen"),
        # Bob's own model may not load alice's checkpoint either.
        "LoadState": lambda: bob.call(t.LoadState, training_pb2.LoadStateRequest(
            op=bob.op(o["bob_model"]), path=o["saved"])),
        "CreateSamplingSession": lambda: bob.call(
            s.CreateSamplingSession, sampling_pb2.CreateSamplingSessionRequest(
                model_path=o["sampler_ckpt"])),
        "Sample": lambda: bob.call(s.Sample, sampling_pb2.SampleRequest(
            sampling_session_id=o["sampler"], prompt=prompt, num_samples=1)),
        "ComputeLogprobs": lambda: bob.call(s.ComputeLogprobs, sampling_pb2.ComputeLogprobsRequest(
            sampling_session_id=o["sampler"], prompt=prompt)),
        "GetRun": lambda: bob.call(r.GetRun, runs_pb2.GetRunRequest(run_id=m)),
        "ListCheckpoints": lambda: bob.call(r.ListCheckpoints,
                                            runs_pb2.ListCheckpointsRequest(run_id=m)),
        "GetCheckpoint": lambda: bob.call(r.GetCheckpoint, runs_pb2.CheckpointRef(path=o["saved"])),
        "DeleteCheckpoint": lambda: bob.call(r.DeleteCheckpoint,
                                             runs_pb2.CheckpointRef(path=o["saved"])),
        "DownloadCheckpoint": lambda: bob.download_checkpoint(o["saved"], tmp / "stolen"),
        "PublishCheckpoint": lambda: bob.call(r.PublishCheckpoint, runs_pb2.PublishCheckpointRequest(
            path=o["saved"], public=True)),
        "SetCheckpointTtl": lambda: bob.call(r.SetCheckpointTtl, runs_pb2.SetCheckpointTtlRequest(
            path=o["saved"], ttl_seconds=3600)),
        "SaveWeightsExternal": lambda: bob.call(
            bob.external.SaveWeightsExternal,
            external_pb2.SaveWeightsExternalRequest(op=bob.op(m), name="stolen")),
        "GetExternalWeightsUrls": lambda: bob.call(
            bob.external.GetExternalWeightsUrls,
            external_pb2.ExternalWeightsUrlsRequest(path=o["external"])),
        "CopyCheckpoint": lambda: bob.call(r.CopyCheckpoint, runs_pb2.CopyCheckpointRequest(
            source_path=o["saved"]), retry=False),
        # An upload is its starter's alone (tests/http/test_adapter_import.py finishes
        # another tenant's real upload over HTTP, where its PUTs go).
        "FinishUpload": lambda: bob.call(bob.external.FinishUpload,
                                         external_pb2.FinishUploadRequest(
                                             upload_id="upl-0123456789abcdef")),
        # Bob's own model may not train on alice's recorded sequence (stable_reinforce).
        "ForwardBackward(stable_reinforce)": lambda: bob.forward(
            bob.op(o["bob_model"]), _stable_reinforce_chunks(o["sequence"], o["sampled"]),
            common_pb2.LossFn(name="stable_reinforce")),
    }


def _stable_reinforce_chunks(sequence_id: str, sampled: np.ndarray) -> list:
    """One rl_loop-style datum whose provenance names `sequence_id` (prompt [5, 6, 7])."""
    prompt = np.array([5, 6, 7], np.int64)
    n = len(sampled)
    datum = wire.encode_datum(np.r_[prompt, sampled[:-1]], {
        "target_tokens": np.r_[prompt[1:], sampled],
        "advantages": np.r_[np.zeros(2), np.ones(n)].astype(np.float32)})
    chunks = wire.pack_request([datum])
    wire.attach_provenance(chunks, [wire.Provenance(
        (wire.Span(sequence_id, 0, 3, False), wire.Span(sequence_id, 0, n - 1, True)),
        (wire.Span(sequence_id, 1, 2, False), wire.Span(sequence_id, 0, n, True)))])
    return chunks


# RPCs that name no other tenant's object: what each returns is checked to be bob's own.
TENANT_SCOPED = {"CreateSession", "GetServerCapabilities", "GetTokenizer", "ListRuns",
                 "GetAuditLog", "StartUpload"}


def test_every_rpc_naming_another_tenants_object_answers_not_found(tenants, tmp_path):
    proc, _, alice, bob, objects = tenants
    cases = _isolation_cases(bob, objects, tmp_path)
    rpcs = {method.name for service in SERVICES for method in service.methods}
    missing = rpcs - set(cases) - TENANT_SCOPED
    assert not missing, f"RPCs with no isolation case: {sorted(missing)}"
    for name, attempt in cases.items():
        with pytest.raises(errors.NotFoundError) as caught:
            attempt()
        assert ": no " in str(caught.value), f"{name}: {caught.value}"
    # Alice's objects are untouched by all of it.
    info = alice.call(alice.training.GetInfo, training_pb2.GetInfoRequest(
        model_id=objects["model"]))
    assert info.model_id == objects["model"]
    listed = alice.call(alice.runs.ListCheckpoints, runs_pb2.ListCheckpointsRequest())
    assert {c.path for c in listed.checkpoints} == {objects["saved"], objects["sampler_ckpt"],
                                                     objects["external"]}
    assert bob.call(bob.runs.ListRuns, runs_pb2.ListRunsRequest()).total == 1
    assert bob.call(bob.runs.ListCheckpoints, runs_pb2.ListCheckpointsRequest()).total == 0
    # Yesterday's and today's (UTC): the module's setup may have been before midnight.
    entries = [e for day in audit_days() for e in bob.call(
        bob.runs.GetAuditLog, runs_pb2.GetAuditLogRequest(event_type="all",
                                                          day=day.isoformat())).entries]
    assert entries and not any(objects["model"] in e.event_details_json for e in entries)
    alice.call(alice.session.Heartbeat, session_pb2.HeartbeatRequest(
        session_id=objects["session"]))


def test_the_bearer_scheme_is_read_in_any_case_as_over_http(tenants):
    """RFC 7235: `bearer KEY` and `BEARER KEY` are `Bearer KEY`; another scheme is none."""
    proc, keys, *_ = tenants
    transport = Transport(proc.address)
    try:
        for scheme in ("bearer", "BEARER", "Bearer"):
            transport.metadata = (("authorization", f"{scheme} {keys['alice']}"),)
            transport.call(transport.runs.ListRuns, runs_pb2.ListRunsRequest())
        transport.metadata = (("authorization", f"Basic {keys['alice']}"),)
        with pytest.raises(grpc.RpcError) as refused:
            transport.call(transport.runs.ListRuns, runs_pb2.ListRunsRequest())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        transport.channel.close()


def test_keys_are_stored_only_as_hashes_and_never_logged(tenants):
    proc, keys, alice, _, _ = tenants
    alice.call(alice.session.GetServerCapabilities, common_pb2.Empty())
    with sqlite3.connect(proc.data_dir / "twinkle.db") as db:
        db.execute("PRAGMA wal_checkpoint(FULL)")
    stored = b"".join(p.read_bytes() for p in proc.data_dir.glob("twinkle.db*"))
    log = proc.log()
    for key in keys.values():
        assert key.encode() not in stored
        assert key not in log
    assert "op model=" in log  # the log does record the ops themselves


def _self_signed(tmp: Path) -> tuple[Path, Path, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    (tmp / "cert.pem").write_bytes(pem)
    (tmp / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    return tmp / "cert.pem", tmp / "key.pem", pem


def test_tls_round_trip_with_a_self_signed_certificate(tmp_path, tiny_cache):
    cert, key, pem = _self_signed(tmp_path)
    proc = start_server(tmp_path / "data", "--tls-cert", str(cert), "--tls-key", str(key),
                        tls_ca=pem)
    try:
        with Connection(f"https://{proc.address}", client_name="test",
                        root_certificates=pem) as conn:
            model = conn.create_model(training_pb2.CreateModelRequest(lora=small_lora())).model_id
            result = conn.forward(conn.op(model), packed_datums(),
                                  common_pb2.LossFn(name="cross_entropy"))
            assert np.isfinite(result.loss) and result.outputs[0]["logprobs"].shape == (8,)
        # The same server refuses a plaintext client: the handshake fails, nothing is served.
        with pytest.raises(errors.UnavailableError):
            Connection(f"http://{proc.address}", client_name="test")
    finally:
        proc.stop()


def test_per_tenant_session_and_adapter_limits_hold_back_only_that_tenant(tmp_path, tiny_cache):
    data_dir = tmp_path / "limits"
    keys = {t: create_key(data_dir, t) for t in ("greedy", "polite")}
    proc = start_server(data_dir, "--max-sessions-per-tenant", "2",
                        "--max-adapters-per-tenant", "1")
    try:
        first = Connection(proc.address, keys["greedy"], client_name="test")
        second = Connection(proc.address, keys["greedy"], client_name="test")
        with pytest.raises(errors.ResourceExhaustedError, match="--max-sessions-per-tenant"):
            Connection(proc.address, keys["greedy"], client_name="test")
        first.create_model(training_pb2.CreateModelRequest(lora=small_lora()))
        with pytest.raises(errors.ResourceExhaustedError, match="--max-adapters-per-tenant"):
            second.create_model(training_pb2.CreateModelRequest(lora=small_lora()))
        with Connection(proc.address, keys["polite"], client_name="test") as polite:
            polite.create_model(training_pb2.CreateModelRequest(lora=small_lora()))
        first.close()  # frees the session and the adapter slot
        second.create_model(training_pb2.CreateModelRequest(lora=small_lora()))
        second.close()
    finally:
        proc.stop()
