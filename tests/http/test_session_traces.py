"""Session traces through the stock SDK: `RestClient.export_session_trace` gives a signed
URL to Chrome trace-event JSON (what ui.perfetto.dev opens) holding the session's ops in
the order they ran, each with its time queued and running, on a track per model or
sampler, with counter tracks beside; another tenant's export of it is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from itertools import pairwise

import httpx
import pytest
import tinker
from tinker import types

from .conftest import sft_data

pytestmark = pytest.mark.integration


def test_a_sessions_trace_holds_its_ops_in_order_and_only_its_tenant_exports_it(
        server, base_url, bob, tmp_path):
    client = tinker.ServiceClient(base_url=base_url, api_key=server.keys["alice"])
    session_id = client.holder.get_session_id()
    training = client.create_lora_training_client(base_model="tiny", rank=4).result()
    training.forward_backward(sft_data(n=2), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = training.save_weights_and_get_sampling_client("traced")
    sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2,
                   types.SamplingParams(max_tokens=4, seed=1)).result()
    url = client.create_rest_client().export_session_trace(session_id).result()
    trace = json.loads(httpx.get(url, timeout=30).content)
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    model_track = next(t for t, name in tracks.items() if name == f"model {training.model_id}")
    ran = [e for e in events if e["ph"] == "X" and e["name"] != "queued"]
    assert [e["name"] for e in ran if e["tid"] == model_track] == [
        "forward_backward", "optim_step", "save_sampler"]
    assert any(e["name"] == "sample" and tracks[e["tid"]].startswith("sampler ") for e in ran)
    assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in pairwise(ran))
    forward = next(e for e in ran if e["name"] == "forward_backward")
    assert forward["args"]["tokens"] == 32 and forward["args"]["outcome"] == "ok"
    assert forward["args"]["tenants_in_pass"] >= 1 and "tenant" not in forward["args"]
    assert forward["args"]["bytes_out"] == 32 * 4          # its float32 logprobs
    sample = next(e for e in ran if e["name"] == "sample")
    assert sample["args"]["decode_slices"] >= 1
    assert sample["args"]["bytes_out"] == 2 * 4 * (4 + 4)  # 2 x 4 int32 tokens, logprobs
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"queue depth", "KV positions used", "adapter page-ins",
                        "decode tokens/s"}
    with pytest.raises(tinker.NotFoundError):
        bob.create_rest_client().export_session_trace(session_id).result()
    assert httpx.get(url.replace("signature=", "signature=0"), timeout=30).status_code == 403
    client.close("success").result()
    _the_operator_reads_it_without_a_key(server, session_id, tmp_path)


def _the_operator_reads_it_without_a_key(server, session_id, tmp_path) -> None:
    """`twinkle-server sessions trace ID` beside the server: the same trace, from the
    data dir alone; a session the server never traced is refused by name."""
    out = tmp_path / "operator.json"
    done = _cli("sessions", "trace", session_id, "-o", str(out), "--data-dir",
                str(server.data_dir))
    assert done.returncode == 0, done.stderr
    names = [e["name"] for e in json.loads(out.read_bytes())["traceEvents"]]
    assert {"forward_backward", "optim_step", "sample"} <= set(names)
    missing = _cli("sessions", "trace", "sess-none", "--data-dir", str(server.data_dir))
    assert missing.returncode == 1 and "'sess-none': no op of it" in missing.stderr
    unsigned = httpx.get(f"http://{server.http_address}/api/v1/operator/session_traces/"
                         f"{session_id}?expires=9999999999&signature=00", timeout=30)
    assert unsigned.status_code == 403


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twinkle_server.cli", *args],
                          capture_output=True, text=True, timeout=120)
