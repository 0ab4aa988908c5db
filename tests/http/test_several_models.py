"""Two base models behind one endpoint (`--models`), driven by the stock `tinker` SDK: a
student (`tiny`, role train) and a teacher of another shape (`tiny-large`, role sample).

Each model runs on its own engine, so what one returns must not depend on the other being
there: the teacher's logprobs and seeded samples are compared with a server holding only
`tiny-large`, the student's loss with the package's one-model `tiny` server. Both are the
same code on the same shapes on this machine, so they agree to float32 rounding (1e-5 on
logprobs of order 10); the seeded tokens are equal.
"""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from twinkle_server.process import start_server

from ..numerics import assert_rows_alike, neighbours_could_draw, sdk_score
from ..service.harness import create_key
from .conftest import sft_data

pytestmark = pytest.mark.integration

MODELS = """
[[models]]
name = "student"
path = "tiny"
aliases = ["tiny"]

[[models]]
name = "teacher"
path = "tiny-large"
aliases = ["Teacher/Large"]
role = "sample"
"""
PROMPT = types.ModelInput.from_ints(list(range(5, 29)))
TOLERANCE = 1e-5


def _serve(tmp_path_factory, name: str, *args: str):
    data_dir = tmp_path_factory.mktemp(name)
    key = create_key(data_dir, "alice")
    proc = start_server(data_dir, *args, http=True)
    proc.key = key
    client = tinker.ServiceClient(base_url=f"http://{proc.http_address}", api_key=key)
    return proc, client


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_cache):
    models = tmp_path_factory.mktemp("models") / "models.toml"
    models.write_text(MODELS)
    proc, client = _serve(tmp_path_factory, "pair", "--models", str(models))
    yield proc, client
    client.close("success").result()
    proc.stop()


@pytest.fixture(scope="module")
def teacher_alone(tmp_path_factory, tiny_cache):
    proc, client = _serve(tmp_path_factory, "teacher-alone", "--model", "tiny-large")
    yield client
    client.close("success").result()
    proc.stop()


def _teacher_outputs(client: tinker.ServiceClient, base_model: str):
    sampler = client.create_sampling_client(base_model=base_model).result()
    logprobs = sampler.compute_logprobs(PROMPT).result()
    sample = sampler.sample(PROMPT, 2, types.SamplingParams(max_tokens=12, seed=7,
                                                            temperature=1.0)).result()
    return np.array(logprobs[1:], np.float64), sample.sequences, sampler


def test_both_models_are_listed_with_their_roles(pair):
    proc, _ = pair
    key = create_key(proc.data_dir, "lister")
    rest = tinker.RestClient(base_url=f"http://{proc.http_address}", api_key=key)
    caps = rest.get_server_capabilities().result()
    listed = {m.model_name: (m.trainable, m.sampleable) for m in caps.supported_models}
    assert listed == {"student": (True, True), "tiny": (True, True),
                      "teacher": (False, True), "Teacher/Large": (False, True)}


def test_the_teacher_gives_what_it_gives_served_alone(pair, teacher_alone):
    _, client = pair
    together, together_seqs, _ = _teacher_outputs(client, "teacher")
    alone, alone_seqs, sampler = _teacher_outputs(teacher_alone, "tiny-large")
    np.testing.assert_allclose(together, alone, atol=TOLERANCE, rtol=0)
    # Seeded: the same tokens up to a near tie (tests/numerics.py), logprobs within
    # LOGPROB_ATOL up to there.
    assert_rows_alike(alone_seqs, together_seqs, lambda row: neighbours_could_draw(
        alone_seqs[row].tokens, sdk_score(sampler, PROMPT.to_ints())))


def test_the_student_trains_as_on_a_one_model_server(pair, service):
    _, client = pair
    losses = []
    for svc in (client, service):
        tc = svc.create_lora_training_client(base_model="tiny", rank=4, seed=11)
        tc = tc.result()
        out = tc.forward_backward(sft_data(n=2), "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_a_sample_model_refuses_training_clients_naming_its_role(pair):
    _, client = pair
    with pytest.raises(tinker.APIStatusError, match="role 'sample'") as refused:
        client.create_lora_training_client(base_model="teacher", rank=4).result()
    assert refused.value.status_code == 412   # FAILED_PRECONDITION


def test_a_checkpoint_samples_on_its_own_base_and_nowhere_else(pair):
    proc, client = pair
    tc = client.create_lora_training_client(base_model="student", rank=4, seed=3).result()
    tc.forward_backward(sft_data(n=1), "cross_entropy").result()
    path = tc.save_weights_for_sampler("s1").result().path
    sampler = client.create_sampling_client(model_path=path).result()
    assert sampler.compute_logprobs(PROMPT).result()[1] is not None
    with pytest.raises(tinker.BadRequestError, match="trained on 'student'"):
        client.create_sampling_client(model_path=path, base_model="teacher").result()
    state = tc.save_state("w1").result().path
    with pytest.raises(Exception, match="trained on base model 'student'"):
        client.create_training_client_from_state(state, base_model="teacher").result()
    resumed = client.create_training_client_from_state(state).result()
    assert resumed.get_info().model_data.model_name in ("student", "tiny")
    # The REST checkpoint views say the base (Tinker 0.39's Checkpoint.base_model).
    run_id = path.split("/")[2]
    listed = httpx.get(f"http://{proc.http_address}/api/v1/training_runs/{run_id}/checkpoints",
                       headers={"x-api-key": proc.key}, timeout=30).json()["checkpoints"]
    assert {c["base_model"] for c in listed} == {"student"}


def test_metrics_carry_each_model_name(pair):
    proc, client = pair
    sampler = client.create_sampling_client(base_model="teacher").result()
    sampler.compute_logprobs(PROMPT).result()
    text = httpx.get(f"http://{proc.http_address}/metrics").text
    bases = {s.labels.get("base_model") for family in text_string_to_metric_families(text)
             for s in family.samples if s.name == "twinkle_ops_total"}
    assert {"student", "teacher"} <= bases
    kv = {s.labels["base_model"] for family in text_string_to_metric_families(text)
          for s in family.samples if s.name == "twinkle_kv_pool_positions"}
    assert kv == {"student", "teacher"}


def test_grpc_clients_route_by_base_model_alike(pair):
    """`tinker_compat` (gRPC) and the native client see the same two models, and the
    teacher's logprobs over gRPC are the HTTP front's."""
    from tinker_compat import ServiceClient
    from twinkle_client import api
    from twinkle_client.connection import Connection

    proc, client = pair
    key = create_key(proc.data_dir, "grpc")
    grpc = ServiceClient(base_url=f"http://{proc.address}", api_key=key)
    connection = Connection(f"http://{proc.address}", api_key=key, client_name="test")
    try:
        caps = api.capabilities(connection)
        roles = {m.name: (m.role, m.limits.max_rank) for m in caps.models}
        assert roles == {"student": ("train", 128), "teacher": ("sample", 128)}
        over_grpc = grpc.create_sampling_client(base_model="Teacher/Large").result()
        over_http = client.create_sampling_client(base_model="teacher").result()
        np.testing.assert_allclose(over_grpc.compute_logprobs(PROMPT).result()[1:],
                                   over_http.compute_logprobs(PROMPT).result()[1:],
                                   atol=TOLERANCE, rtol=0)
        with pytest.raises(Exception, match="role 'sample'"):
            grpc.create_lora_training_client(base_model="teacher", rank=4).result()
        # The native client: its model names a base, its adapters train on that base.
        from peft import LoraConfig

        from twinkle_client import MultiLoraTransformersModel
        student = MultiLoraTransformersModel("student", connection)
        info = student.add_adapter_to_model("a", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"), seed=1)
        assert info.base_model == "student"
        teacher = MultiLoraTransformersModel("ms://Teacher/Large", connection)
        with pytest.raises(Exception, match="role 'sample'"):
            teacher.add_adapter_to_model("a", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    finally:
        grpc.close()
        connection.close()


def test_adapters_import_beside_the_server_takes_its_models_and_the_adapters_base(
        pair, tmp_path):
    """`twinkle-server adapters import` with only the data dir: the served models and
    limits come from what the server recorded there (`served.json`), and each PEFT
    adapter goes to the base its `base_model_name_or_path` names: one trained on
    tiny-large to the teacher, which then samples peft's logprobs. It was checked
    against tiny (the CLI's default) and refused before."""
    import subprocess
    import sys

    from twinkle_server.engine.tiny_model import TINY_LARGE_NAME

    from ..numerics import LOGPROB_ATOL
    from .test_adapter_import import TOKENS, _peft_adapter

    proc, client = pair
    paths = {}
    for base, served in (("tiny", "student"), (TINY_LARGE_NAME, "teacher")):
        directory, want = _peft_adapter(tmp_path / base, base=base)
        cli = subprocess.run([sys.executable, "-m", "twinkle_server.cli", "adapters", "import",
                              str(directory), "--tenant", "alice", "--data-dir",
                              str(proc.data_dir)], capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items()
                                  if not k.startswith("TWINKLE_")})
        assert cli.returncode == 0, cli.stderr
        paths[served] = cli.stdout.strip()
        sampler = client.create_sampling_client(model_path=paths[served]).result()
        got = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:]
        np.testing.assert_allclose(got, want, atol=LOGPROB_ATOL, rtol=0)
