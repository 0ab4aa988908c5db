"""`served.json`: what a data dir's server serves, for the tools run beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from twinkle_server.config.model_table import ModelConfig
from twinkle_server.config.served import SERVED_FILE, pick, read_served, write_served
from twinkle_server.engine.errors import InvalidArgument

STUDENT = (ModelConfig("student", "tiny", aliases=("Org/Student",), max_rank=16),
           Path("/models/tiny"))
TEACHER = (ModelConfig("teacher", "/models/large", role="sample", ranks=(0, 1)),
           Path("/models/large"))


def test_what_the_server_wrote_reads_back_as_it_was(tmp_path):
    assert read_served(tmp_path) is None
    write_served(tmp_path, [STUDENT, TEACHER])
    assert read_served(tmp_path) == [STUDENT, TEACHER]
    assert [p.name for p in tmp_path.iterdir()] == [SERVED_FILE]    # nothing half-written


def test_a_file_that_is_not_a_record_is_refused_naming_it(tmp_path):
    (tmp_path / SERVED_FILE).write_text('{"models": [{"name": 3}]}')
    with pytest.raises(InvalidArgument, match="served.json: not a record of served models"):
        read_served(tmp_path)


@pytest.mark.parametrize(("wanted", "named", "picked"), [
    ("", "Org/Student", "student"),           # the adapter's base, by an alias
    ("", "/models/large", "teacher"),         # by its path or directory
    ("teacher", "Org/Student", "teacher"),    # --base-model wins
])
def test_the_adapter_goes_to_the_base_it_names_unless_told(wanted, named, picked):
    assert pick([STUDENT, TEACHER], wanted, named)[0].name == picked


def test_a_base_none_serves_is_refused_unless_only_one_is_served():
    assert pick([TEACHER], "", "/home/someone/Qwen3-8B")[0].name == "teacher"
    with pytest.raises(InvalidArgument, match="--base-model: the adapter was trained on "
                                              "/home/someone/Qwen3-8B, which is none of"):
        pick([STUDENT, TEACHER], "", "/home/someone/Qwen3-8B")
    with pytest.raises(InvalidArgument, match="--base-model: 'nope' is not one of"):
        pick([STUDENT, TEACHER], "nope", "")
