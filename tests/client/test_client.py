"""TwinkleClient against a real server: pydantic records, listings oldest first, the
latest checkpoint, delete, download, health, capacity, and errors carrying the server's
message."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig
from safetensors.numpy import load_file

from twinkle_client import TwinkleClient, init_twinkle_client
from twinkle_client.connection import Connection, get_default_connection
from twinkle_client.errors import NotFoundError
from twinkle_client.model import MultiLoraTransformersModel

from .conftest import toy_features

pytestmark = pytest.mark.integration


@pytest.fixture
def trained(client):
    """A model with one training step and two checkpoints, 'first' then 'second'."""
    model = MultiLoraTransformersModel("ms://tiny")
    model.add_adapter_to_model("default", LoraConfig(r=4, target_modules="all-linear"))
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=1e-3)
    model.forward_backward(toy_features(2))
    model.clip_grad_and_step()
    first = model.save("first", save_optimizer=True)
    second = model.save("second")
    return model, first, second


def test_runs_and_checkpoints_are_pydantic_records_listed_oldest_first(client, trained):
    model, first, second = trained
    runs = client.list_training_runs()
    run = next(r for r in runs if r.training_run_id == model.training_run_id)
    assert runs[-1].training_run_id == model.training_run_id  # the newest run comes last
    assert run.base_model == "tiny" and run.lora_rank == 4 and run.loaded
    assert run.last_checkpoint.twinkle_path == second
    dumped = json.loads(run.model_dump_json())
    assert dumped["training_run_id"] == model.training_run_id
    assert dumped["last_checkpoint"]["twinkle_path"] == second
    checkpoints = client.list_checkpoints(model.training_run_id)
    assert [c.twinkle_path for c in checkpoints] == [first, second]
    assert [c.has_optimizer for c in checkpoints] == [True, False]
    assert checkpoints[0].tinker_path == first.replace("twinkle://", "tinker://")
    assert json.loads(checkpoints[0].model_dump_json())["checkpoint_type"] == "training"
    assert client.get_latest_checkpoint_path(model.training_run_id) == second
    assert client.get_training_run(model.training_run_id) == run.model_copy(
        update={"last_request_time": client.get_training_run(
            model.training_run_id).last_request_time})


def test_list_training_runs_pages_by_limit_and_offset(client, trained):
    everything = client.list_training_runs()
    assert client.list_training_runs(limit=1, offset=len(everything) - 1) == everything[-1:]
    assert client.list_training_runs(offset=1) == everything[1:]
    with pytest.raises(ValueError, match="limit: must be >= 0"):
        client.list_training_runs(limit=-1)


def test_delete_removes_a_checkpoint_and_a_second_delete_is_not_found(client, trained):
    model, first, second = trained
    client.delete_checkpoint(first)
    assert [c.twinkle_path for c in client.list_checkpoints(model.training_run_id)] == [second]
    with pytest.raises(NotFoundError, match="no checkpoint"):
        client.delete_checkpoint(first)


def test_download_writes_peft_files_that_hold_the_adapter(client, trained, tmp_path):
    _, first, _ = trained
    folder = client.download_checkpoint(first, tmp_path / "ckpt")
    assert folder == tmp_path / "ckpt"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    assert any("lora_A" in k for k in tensors) and any("lora_B" in k for k in tensors)


def test_unknown_run_raises_not_found_with_the_servers_message(client):
    with pytest.raises(NotFoundError, match="run_id: no run 'run-nope'"):
        client.get_training_run("run-nope")
    with pytest.raises(NotFoundError, match="run_id: no run 'run-nope'"):
        client.list_checkpoints("run-nope")


def test_health_check_is_true_on_the_server_and_false_when_unreachable(client):
    assert client.health_check()
    dead = TwinkleClient(Connection("127.0.0.1:1", client_name="test", open_session=False))
    try:
        assert dead.health_check(timeout=1.0) is False
    finally:
        dead.close()


def test_capabilities_name_the_served_model_and_capacity_counts_adapters(client):
    caps = client.get_server_capabilities()
    assert [m.name for m in caps.models] == ["tiny"]
    assert "CrossEntropyLoss" in caps.loss_functions and "AdamW" in caps.optimizers
    assert json.loads(caps.model_dump_json())["limits"]["max_adapters_per_tenant"] == 32
    before = client.get_capacity_info()
    model = MultiLoraTransformersModel("tiny")
    model.add_adapter_to_model("default", {"r": 2, "target_modules": ["q_proj"]})
    after = client.get_capacity_info()
    assert after.adapters_loaded == before.adapters_loaded + 1
    assert after.adapters_free == before.adapters_free - 1
    assert after.memory_available_bytes > 0


def test_init_reads_the_environment_sets_the_default_and_close_unsets_it(server, monkeypatch):
    monkeypatch.delenv("TWINKLE_BASE_URL", raising=False)
    with pytest.raises(ValueError, match="base_url: not given and TWINKLE_BASE_URL is not set"):
        init_twinkle_client()
    monkeypatch.setenv("TWINKLE_BASE_URL", server.address)
    monkeypatch.setenv("TWINKLE_API_KEY", "EMPTY_TOKEN")
    client = init_twinkle_client()
    assert get_default_connection() is client.connection
    assert client.connection.metadata == (("authorization", "Bearer EMPTY_TOKEN"),)
    assert client.list_training_runs() is not None
    client.close()
    assert get_default_connection() is None
