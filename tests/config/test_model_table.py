"""`--models FILE`: each `[[models]]` table read with the flags as its defaults; a file
that cannot work is refused before anything loads, naming the table and the key."""

from __future__ import annotations

import subprocess
import sys

import pytest

from twinkle_server.config.flags import ServerConfig
from twinkle_server.config.model_table import SAMPLE, TRAIN, ModelConfig, shorthand
from twinkle_server.engine.errors import InvalidArgument


def _models(tmp_path, text: str, **flags):
    path = tmp_path / "models.toml"
    path.write_text(text)
    return ServerConfig(models=path, **flags).model_configs()


def test_each_table_takes_the_flags_as_defaults_and_overrides_its_own(tmp_path):
    student, teacher = _models(tmp_path, """
[[models]]
name = "Qwen/Qwen3-8B"
path = "tiny"
aliases = ["student"]
max_rank = 16

[[models]]
name = "tiny-large"
role = "sample"
device = "cpu"
memory_gib = 1.5
kv_pool_tokens = 4096
""", max_rank=64, max_adapters=5)
    assert (student.name, student.path, student.aliases) == ("Qwen/Qwen3-8B", "tiny",
                                                            ("student",))
    assert (student.role, student.max_rank, student.max_adapters) == (TRAIN, 16, 5)
    assert (teacher.path, teacher.role, teacher.max_rank) == ("tiny-large", SAMPLE, 64)
    assert teacher.limits().memory_bytes == int(1.5 * 2**30)
    assert teacher.limits().kv_pool_tokens == 4096


def test_the_one_model_shorthand_is_tiny_with_its_aliases():
    (model,) = ServerConfig(model_alias=("Qwen/Qwen3-4B",)).model_configs()
    assert (model.name, model.path, model.aliases, model.role) == (
        "tiny", "tiny", ("Qwen/Qwen3-4B",), TRAIN)


@pytest.mark.parametrize(("text", "named"), [
    ("[[models]]\npath = 'tiny'\n", "#1: key 'name' is missing"),
    ("[[models]]\nname = 'a'\nrank = 3\n", "#1 ('a'): unknown key 'rank'"),
    ("[[models]]\nname = 'a'\n[[models]]\nname = 'b'\nrole = 'grade'\n",
     "#2 ('b'): key 'role' is 'grade'"),
    ("[[models]]\nname = 'a'\nmax_rank = -1\n", "key 'max_rank' is -1; give an integer >= 1"),
    ("[[models]]\nname = 'a'\nmax_rank = '8'\n", "key 'max_rank' is '8'"),
    ("[[models]]\nname = 'a'\naliases = 'b'\n", "key 'aliases' is 'b'; give a list"),
    ("[[models]]\nname = 'a'\nranks = [0, 0]\n", "give a list without repeats"),
    ("[[models]]\nname = 'a'\nmemory_gib = -2\n", "key 'memory_gib' is -2"),
    ("[[models]]\nname = 'a'\n[[models]]\nname = 'b'\naliases = ['a']\n",
     "name 'a' is given to both 'a' and 'b'"),
    ("[[models]]\nname = 'a'\n[[models]]\nname = 'a'\n", "'a' is listed twice"),
    ("[server]\nport = 1\n", "unknown top-level key 'server'"),
    ("models = []\n", "no [[models]] table"),
    ("[[models]\nname = 'a'\n", "not TOML"),
])
def test_a_file_that_cannot_work_is_refused_naming_table_and_key(tmp_path, text, named):
    with pytest.raises(InvalidArgument, match="--models .*models.toml") as refused:
        _models(tmp_path, text)
    assert named in str(refused.value)


def test_model_and_models_together_are_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="--model .* or --models FILE"):
        _models(tmp_path, "[[models]]\nname = 'a'\n", model="tiny")


def test_the_server_refuses_a_bad_file_at_start_with_its_message(tmp_path):
    models = tmp_path / "models.toml"
    models.write_text("[[models]]\nname = 'teacher'\nrole = 'judge'\n")
    run = subprocess.run([sys.executable, "-m", "twinkle_server.cli", "serve", "--models",
                          str(models), "--data-dir", str(tmp_path / "data")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "[[models]] #1 ('teacher'): key 'role' is 'judge'" in run.stderr


SEVERAL = "[[models]]\nname = 'a'\npath = 'tiny'\n[[models]]\nname = 'b'\npath = 'tiny'\n"


@pytest.mark.parametrize(("extra", "flags", "named"), [
    ("ranks = [1]\n", {}, "'b' has ranks [1]; every model's ranks include rank 0"),
    ("ranks = [0, 2]\n", {}, "'b' asks for ranks [0, 2], but the job has 2"),
    ("device = 'cuda'\n", {}, "'b' asks for device 'cuda', but the job's ranks run on cpu"),
    ("", {"shard_group_size": 1}, "--shard-group-size 1: hybrid sharding serves one model"),
])
def test_several_models_on_several_ranks_refuse_what_cannot_work(tmp_path, monkeypatch, extra,
                                                                  flags, named):
    from twinkle_server.ranks.launch import several_ranks_problem

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "models.toml"
    path.write_text(SEVERAL + extra)
    config = ServerConfig(models=path, **{"device": "cpu", **flags})
    assert named in several_ranks_problem(config, 2)


ONE = "[[models]]\nname = 'a'\npath = 'tiny'\n"


@pytest.mark.parametrize(("text", "flags", "world", "named"), [
    (ONE + "ranks = [1]\n", {}, 2, "'a' has ranks [1]; every model's ranks include rank 0"),
    (ONE + "ranks = [0, 2]\n", {}, 2, "'a' asks for ranks [0, 2], but the job has 2"),
    (ONE + "ranks = [0, 1]\n", {}, 1, "'a' asks for ranks [0, 1], but the job has 1"),
    (ONE + "device = 'cuda'\n", {}, 2,
     "'a' asks for device 'cuda', but the job's ranks run on cpu"),
    (ONE + "device = 'cuda:0'\n", {"device": "cuda"}, 2,
     "'a' asks for device 'cuda:0'; on several ranks each rank runs on its own"),
    (ONE, {"device": "cuda:1"}, 2,
     "--device cuda:1: on several ranks each rank runs on its own"),
    (ONE + "ranks = [0]\n", {}, 2, "rank 1 is in no model's ranks"),
    (SEVERAL.replace("path = 'tiny'\n", "path = 'tiny'\nranks = [0]\n"), {}, 3,
     "ranks 1, 2 are in no model's ranks"),
])
def test_a_models_ranks_and_device_are_honoured_or_refused_by_name(tmp_path, monkeypatch,
                                                                   text, flags, world, named):
    """One model's table is checked as several models' are: its ranks and device are never
    silently ignored, and a rank no model uses (which would hold nothing) is refused."""
    from twinkle_server.ranks.launch import several_ranks_problem

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    path = tmp_path / "models.toml"
    path.write_text(text)
    config = ServerConfig(models=path, **{"device": "cpu", **flags})
    assert named in (several_ranks_problem(config, world) or "")


def test_one_model_on_every_rank_of_the_job_is_accepted(tmp_path, monkeypatch):
    from twinkle_server.ranks.launch import several_ranks_problem

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "models.toml"
    for ranks in ("", "ranks = [0, 1]\n"):
        path.write_text(ONE + ranks)
        assert several_ranks_problem(ServerConfig(models=path, device="cpu"), 2) is None
    path.write_text(ONE + "ranks = [0]\n")
    assert several_ranks_problem(ServerConfig(models=path, device="cpu"), 1) is None


def test_a_device_that_resolves_to_the_jobs_kind_is_accepted_on_several_ranks(
        tmp_path, monkeypatch):
    """'auto' is the kind it resolves to here (cuda where present, else cpu), in a table
    or as the flag: compared by what it means, not by its spelling."""
    from twinkle_server.engine.base_model import resolve_device
    from twinkle_server.ranks.launch import several_ranks_problem

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    here = resolve_device("auto").type
    path = tmp_path / "models.toml"
    path.write_text(ONE + f"device = '{here}'\n")
    assert several_ranks_problem(ServerConfig(models=path, device="auto"), 2) is None
    path.write_text(ONE + "device = 'auto'\n")
    assert several_ranks_problem(ServerConfig(models=path, device=here), 2) is None


def test_several_models_on_several_ranks_that_fit_are_accepted(tmp_path, monkeypatch):
    from twinkle_server.ranks.launch import several_ranks_problem

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    path = tmp_path / "models.toml"
    path.write_text(SEVERAL + "ranks = [0]\n")
    assert several_ranks_problem(ServerConfig(models=path, device="cpu"), 2) is None
    assert several_ranks_problem(ServerConfig(models=path, device="cpu"), 1) is None


def test_rank_0_counts_a_models_kv_pool_only_where_rank_0_holds_it(tmp_path, monkeypatch,
                                                                    tiny_cache):
    """A pool larger than any host: refused for a model rank 0 samples, not for one whose
    sampler ranks hold the pool (rank 0 is among its trainer ranks, which hold none)."""
    from twinkle_server.ranks.launch import several_ranks_problem

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    huge = "kv_pool_tokens = 17179869184\n"            # 2^34 positions
    path = tmp_path / "models.toml"
    path.write_text(SEVERAL + huge + "sampler_ranks = 1\n")
    assert several_ranks_problem(ServerConfig(models=path, device="cpu"), 3) is None
    path.write_text(SEVERAL + huge)
    assert "'b' 32768.00 GiB" in several_ranks_problem(ServerConfig(models=path, device="cpu"),
                                                     3)


def test_sampler_ranks_come_from_the_flag_or_the_table(tmp_path):
    (model,) = ServerConfig(sampler_ranks=2).model_configs()
    assert model.sampler_ranks == 2
    student, teacher = _models(tmp_path, SEVERAL.replace("name = 'b'", "name = 'b'\n"
                                                         "sampler_ranks = 1"), sampler_ranks=0)
    assert (student.sampler_ranks, teacher.sampler_ranks) == (0, 1)
    with pytest.raises(InvalidArgument, match="key 'sampler_ranks' is -1"):
        _models(tmp_path, "[[models]]\nname = 'a'\nsampler_ranks = -1\n")


@pytest.mark.parametrize(("table", "flags", "world", "named"), [
    ("", {}, 1, "sampler_ranks: 'a' asks for 2, but the server runs as one process"),
    ("", {}, 2, "asks for 2 of its 2 ranks, which leaves none to train; give at most 1"),
    ("ranks = [0, 1, 2]\nsampler_ranks = 3\n", {}, 4, "asks for 3 of its 3 ranks"),
    ("role = 'sample'\n", {}, 4, "but its role is 'sample'"),
    ("ranks = [1, 2, 3]\nsampler_ranks = 1\n", {}, 4, "rank 0 serves and trains"),
    ("", {"sampler": "static"}, 4, "--sampler static samples on the trainer ranks"),
    ("", {"shard_group_size": 2}, 4, "--shard-group-size 2 (hybrid sharding) serves colocated"),
    ("", {"adapter_host_memory_gib": 1.0}, 4,
     "--adapter-host-memory-gib: adapters paged out to disk cannot be published to sampler"),
])
def test_a_split_that_cannot_work_is_refused_before_anything_loads(
        tmp_path, monkeypatch, table, flags, world, named):
    from twinkle_server.server import config_problem

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    path = tmp_path / "models.toml"
    path.write_text("[[models]]\nname = 'a'\npath = 'tiny'\n" + table)
    config = ServerConfig(models=path, device="cpu", sampler_ranks=2, **flags)
    assert named in config_problem(config, world)


def test_a_negative_sampler_ranks_flag_is_refused_not_ignored(monkeypatch):
    from twinkle_server.server import config_problem

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    problem = config_problem(ServerConfig(sampler_ranks=-1, device="cpu"), 4)
    assert problem == "--sampler-ranks: -1 must be at least 0"


def test_a_negative_host_budget_for_paged_adapters_is_refused_by_flag():
    from twinkle_server.server import config_problem

    problem = config_problem(ServerConfig(adapter_host_memory_gib=-1.0))
    assert problem.startswith("--adapter-host-memory-gib: -1.0 must be at least 0")


def test_sampler_ranks_on_one_process_are_refused_at_start(tmp_path):
    run = subprocess.run([sys.executable, "-m", "twinkle_server.cli", "serve",
                          "--sampler-ranks", "1", "--data-dir", str(tmp_path / "data")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "sampler_ranks: 'tiny' asks for 1, but the server runs as one process" in run.stderr


def test_the_tokenizer_a_client_is_told_to_load_is_a_hub_id_or_the_directory(
        tmp_path, monkeypatch):
    """A local model served as `student` once answered tokenizer_id "student", which the
    SDK's get_tokenizer asks the hub for. A hub-id name is what any client can load;
    otherwise the model's directory, which a client sharing its files can."""
    local = tmp_path / "weights"
    local.mkdir()
    assert ModelConfig(name="student", path=str(local)).tokenizer_id(local) == str(local)
    aliased = ModelConfig(name="student", path=str(local), aliases=("Qwen/Qwen3-8B",))
    assert aliased.tokenizer_id(local) == "Qwen/Qwen3-8B"
    by_hub_id = ModelConfig(name="Qwen/Qwen3-4B", path="Qwen/Qwen3-4B")
    assert by_hub_id.tokenizer_id(tmp_path / "snapshot") == "Qwen/Qwen3-4B"
    built_in = shorthand({}, "tiny", ("Qwen/Qwen3-4B-Instruct-2507",))
    assert built_in.tokenizer_id(local) == str(local)
    # A name that is a local path (relative here) is not a hub id.
    (tmp_path / "models" / "student").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    relative = ModelConfig(name="models/student", path="models/student")
    assert relative.tokenizer_id(local) == str(local)
