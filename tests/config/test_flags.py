"""The flags and their `TWINKLE_*` environment variables: read, ranged and checked before
anything loads; a value that cannot work is refused naming the flag (or the variable) and
its limit."""

from __future__ import annotations

import math

import pytest

from twinkle_server.cli import build_parser
from twinkle_server.config.flags import ServerConfig, from_args
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.server import config_problem


@pytest.mark.parametrize(("flags", "named"), [
    ({"port": 70000}, "--port: 70000 must be at most 65535"),
    ({"port": -1}, "--port: -1 must be at least 0"),
    ({"http_port": -5}, "--http-port: -5 must be at least -1"),
    ({"http_port": 65536}, "--http-port: 65536 must be at most 65535"),
    ({"max_rank": 0}, "--max-rank: 0 must be at least 1"),
    ({"max_adapters": 0}, "--max-adapters: 0 must be at least 1"),
    ({"max_seq_len": -5}, "--max-seq-len: -5 must be at least 0"),
    ({"max_batch_tokens": 0}, "--max-batch-tokens: 0 must be at least 1"),
    ({"max_pass_tokens": -1}, "--max-pass-tokens: -1 must be at least 0"),
    ({"merge_token_budget": -1}, "--merge-token-budget: -1 must be at least 0"),
    ({"kv_pool_tokens": -1}, "--kv-pool-tokens: -1 must be at least 0"),
    ({"session_timeout": -1.0}, "--session-timeout: -1.0 must be above 0"),
    ({"session_timeout": math.nan}, "--session-timeout: nan must be a finite number"),
    ({"session_timeout": math.inf}, "--session-timeout: inf must be a finite number"),
    ({"max_sessions_per_tenant": 0}, "--max-sessions-per-tenant: 0 must be at least 1"),
    ({"max_adapters_per_tenant": -1}, "--max-adapters-per-tenant: -1 must be at least 1"),
    ({"max_stability_records": -1}, "--max-stability-records: -1 must be at least 1"),
    ({"max_queued_ops": 0}, "--max-queued-ops: 0 must be at least 1"),
    ({"adapter_host_memory_gib": math.nan},
     "--adapter-host-memory-gib: nan must be a finite number"),
    ({"decode_slice_ms": -5.0}, "--decode-slice-ms: -5.0 must be above 0"),
    ({"collective_timeout": 0.0}, "--collective-timeout: 0.0 must be above 0"),
    ({"nproc_per_node": 0}, "--nproc-per-node: 0 must be at least 1"),
    ({"port": 8000, "http_port": 8000},
     "--http-port: 8000 is --port's too; give another, or 0 for a free one"),
])
def test_a_numeric_flag_out_of_its_range_is_refused_naming_the_flag_and_the_limit(
        flags, named):
    assert config_problem(ServerConfig(**flags)) == named


def test_the_edges_of_each_range_are_served():
    assert config_problem(ServerConfig(port=0, http_port=-1, max_seq_len=0,
                                       max_rank=1, max_adapters=1)) is None
    assert config_problem(ServerConfig(port=0, http_port=0)) is None


@pytest.mark.parametrize(("flags", "named"), [
    ({"shard_group_size": 4}, "--shard-group-size 4: hybrid sharding needs several ranks"),
    ({"node_rank": 3}, "--node-rank 3: a node's rank needs several nodes"),
])
def test_flags_of_several_ranks_on_one_process_are_refused_not_ignored(flags, named):
    assert config_problem(ServerConfig(**flags), 1).startswith(named)


def test_a_models_table_limit_below_its_flags_range_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text("[[models]]\nname = 'tiny'\nmax_adapters = 0\n")
    assert config_problem(ServerConfig(models=path)) == (
        f"--models {path}: [[models]] #1 ('tiny'): key 'max_adapters' is 0; give an "
        "integer >= 1")


@pytest.mark.parametrize(("env", "named"), [
    ("TWINKLE_OFFLINE=yes", "TWINKLE_OFFLINE='yes': give one of on, off (as --offline)"),
    ("TWINKLE_SAMPLER=fast",
     "TWINKLE_SAMPLER='fast': give one of continuous, static (as --sampler)"),
    ("TWINKLE_PACKING=true", "TWINKLE_PACKING='true': give one of on, off (as --packing)"),
    ("TWINKLE_PORT=abc", "TWINKLE_PORT='abc': give an integer (as --port)"),
    ("TWINKLE_SESSION_TIMEOUT=soon", "TWINKLE_SESSION_TIMEOUT='soon': give a number "
                                     "(as --session-timeout)"),
])
def test_an_environment_value_a_flag_would_refuse_is_refused_naming_the_variable(
        monkeypatch, env, named):
    name, value = env.split("=")
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgument) as refused:
        from_args(build_parser().parse_args(["serve"]))
    assert str(refused.value) == named


def test_environment_values_are_read_as_their_flags(monkeypatch):
    monkeypatch.setenv("TWINKLE_OFFLINE", "on")
    monkeypatch.setenv("TWINKLE_PORT", "8123")
    monkeypatch.setenv("TWINKLE_DATA_DIR", "/tmp/d")
    config = from_args(build_parser().parse_args(["serve"]))
    assert (config.offline, config.port, str(config.data_dir)) == ("on", 8123, "/tmp/d")
    assert from_args(build_parser().parse_args(["serve", "--port", "9"])).port == 9


def test_a_model_alias_flag_overrides_the_environment_instead_of_adding_to_it(monkeypatch):
    monkeypatch.setenv("TWINKLE_MODEL_ALIAS", "a,b")
    assert from_args(build_parser().parse_args(["serve"])).model_alias == ("a", "b")
    assert from_args(build_parser().parse_args(
        ["serve", "--model-alias", "c"])).model_alias == ("c",)


def test_every_numeric_flag_has_a_range():
    from dataclasses import fields

    unranged = [f.name for f in fields(ServerConfig) if f.type in ("int", "float")
                and not {"least", "above"} & set(f.metadata)]
    assert unranged == []
