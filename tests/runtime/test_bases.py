"""Several base models in one runtime: each has its own engine and worker, names resolve
through every alias, and nothing crosses from one base to another."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from twinkle_server.config.flags import ServerConfig
from twinkle_server.config.model_table import ModelConfig
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import FailedPrecondition, InvalidArgument
from twinkle_server.engine.types import Datum, LoraSpec, LossSpec, SamplingParams
from twinkle_server.runtime import OpRef, Runtime
from twinkle_server.runtime.bases import shared_turns
from twinkle_server.runtime.training import ForwardRequest
from twinkle_server.store import Store

from .conftest import running

STUDENT = ModelConfig("student", "tiny", aliases=("tiny",))
TEACHER = ModelConfig("teacher", "tiny-large", role="sample")
PROMPT = np.arange(5, 21, dtype=np.int64)
LONG_TOKENS = 800


@pytest.fixture(scope="module")
def teacher_engine(tiny_cache) -> Engine:
    return Engine.load("tiny-large", cache_dir=str(tiny_cache))


@pytest.fixture
def pair(engine, teacher_engine, tmp_path):
    yield from running(Runtime(ServerConfig(data_dir=tmp_path),
                               [(STUDENT, engine), (TEACHER, teacher_engine)],
                               Store(tmp_path)))


def _request(model_id: str) -> ForwardRequest:
    ids = np.arange(3, 19, dtype=np.int64)
    datum = Datum(ids[:-1], {"target_tokens": ids[1:],
                             "weights": np.ones(ids.size - 1, np.float32)})
    return ForwardRequest(model_id, [datum], LossSpec("cross_entropy"), True)


def test_a_long_generation_on_the_teacher_never_holds_the_students_training(pair):
    """While the teacher decodes a long sample, the student's create_model and
    forward_backward complete (by completion order): on a shared device the two take
    turns one batch or decode slice at a time."""
    async def scenario():
        session = await pair.sampling.create_session("alice", base_model="teacher")
        long = asyncio.ensure_future(pair.sampling.sample(
            pair.sampling.target("alice", None, session), PROMPT, 2,
            SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True, seed=1)))
        deadline = time.monotonic() + 60
        while not pair.base("teacher").engine.decode_stats().active_rows:
            assert time.monotonic() < deadline, "the long sample never started decoding"
            await asyncio.sleep(0.01)
        info = await pair.training.create_model("alice", spec=LoraSpec(rank=4, alpha=8, seed=1),
                                                base_model="tiny")
        model_id = info.entry.model_id
        out = await pair.training.forward("alice", OpRef(model_id, 0), _request(model_id))
        assert np.isfinite(out.metrics["loss:sum"])
        assert not long.done()
        result = await long
        assert [s.tokens.size for s in result.sequences] == [LONG_TOKENS] * 2
    asyncio.run(scenario())


def test_models_take_turns_only_on_a_device_they_share():
    cpu = shared_turns(["cpu", "cpu"])
    assert cpu[0] is cpu[1] is not None
    gpus = shared_turns(["cuda:0", "cuda:1", "cuda:0"])
    assert gpus[0] is gpus[2] is not None and gpus[1] is None
    assert shared_turns(["cuda:0"]) == [None]


def test_names_resolve_through_aliases_and_unknown_ones_list_what_is_served(pair):
    assert pair.base("tiny") is pair.base("student") is pair.bases.default
    assert pair.base("teacher").engine.base.config.hidden_size == 192
    with pytest.raises(InvalidArgument, match=r"'nope' is not served here; served names are "
                                              r"\['student', 'tiny', 'teacher'\]"):
        pair.base("nope")


def test_a_checkpoint_loads_only_into_a_model_of_its_base(pair, tmp_path):
    async def scenario():
        info = await pair.training.create_model("alice", spec=LoraSpec(rank=4, alpha=8, seed=1),
                                                base_model="student")
        model_id = info.entry.model_id
        row = await pair.training.save("alice", OpRef(model_id, 0), "training", "w0")
        assert pair.checkpoint_base(row) is pair.base("student")
        with pytest.raises(FailedPrecondition, match="trained on base model 'student'; it "
                                                     "cannot load into a model of 'teacher'"):
            pair.check_same_base(row, pair.base("teacher"))
        with pytest.raises(FailedPrecondition, match="role 'sample'"):
            await pair.training.create_model("alice", spec=LoraSpec(rank=4, alpha=8),
                                             base_model="teacher")
    asyncio.run(scenario())


def test_a_restart_without_a_checkpoints_base_refuses_it_naming_the_base(
        pair, teacher_engine, tmp_path):
    """The store keeps each run's base: after a restart that no longer serves it, its
    checkpoints are refused by name, never loaded into whatever the server now holds."""
    async def save():
        info = await pair.training.create_model("alice", spec=LoraSpec(rank=4, alpha=8, seed=1),
                                                base_model="student")
        return await pair.training.save("alice", OpRef(info.entry.model_id, 0), "sampler", "s0")
    row = asyncio.run(save())
    restarted = Runtime(ServerConfig(data_dir=tmp_path), [(TEACHER, teacher_engine)],
                        pair.store)
    try:
        with pytest.raises(FailedPrecondition, match="trained on base model 'student', which "
                                                     "this server no longer serves"):
            restarted.checkpoint_base(row)
    finally:
        restarted.close()
