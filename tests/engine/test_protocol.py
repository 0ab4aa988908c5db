"""Every engine call the runtime makes is classified once: `@replicated` (every rank runs
it) or `@rank_zero_only` (rank 0 alone), and `ReplicatedEngine` does what the mark says.

A new public `Engine` method without a mark fails here, so a state-changing method cannot
silently run on rank 0 only (the other ranks' adapters would drift apart, or rank 0 would
wait alone in a collective)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest

from twinkle_server.engine.engine import Engine
from twinkle_server.engine.protocol import EngineAPI, marked, ranks_of
from twinkle_server.engine.types import LoraSpec
from twinkle_server.ranks.replication import REPLICATED, ReplicatedEngine
from twinkle_server.ranks.split import SplitEngine

CONSTRUCTORS = {"load"}
"""Public names of `Engine` that build an engine rather than call one."""
PROPERTIES = {"base", "limits", "adapters"}
"""Read on rank 0 (the same on every rank)."""


def _public_methods(cls: type) -> set[str]:
    return {name for name in dir(cls)
            if not name.startswith("_") and name not in CONSTRUCTORS
            and not isinstance(inspect.getattr_static(cls, name), property)
            and callable(getattr(cls, name))}


def _protocol_members() -> set[str]:
    return {name for name in vars(EngineAPI) if not name.startswith("_")}


def test_every_public_engine_method_is_replicated_or_rank_zero_only():
    unmarked = sorted(name for name in _public_methods(Engine)
                      if ranks_of(getattr(Engine, name)) is None)
    assert not unmarked, (
        f"Engine methods {unmarked} are neither @replicated (it changes adapter or sampler "
        "state, or runs the base: every rank must run it) nor @rank_zero_only (it reads, "
        "checks or saves only): mark each (engine.protocol)")
    assert REPLICATED == marked(Engine, "replicated")
    assert not REPLICATED & marked(Engine, "rank_zero_only")


def test_the_protocol_is_the_engines_public_surface():
    assert _protocol_members() == _public_methods(Engine) | PROPERTIES
    for name in _protocol_members() - PROPERTIES:
        want = list(inspect.signature(getattr(EngineAPI, name)).parameters)
        for cls in (Engine, ReplicatedEngine, SplitEngine):
            got = list(inspect.signature(getattr(cls, name)).parameters)
            if isinstance(inspect.getattr_static(cls, name), staticmethod):
                got = ["self", *got]
            assert got == want, f"{cls.__name__}.{name}{got} differs from EngineAPI's {want}"


@pytest.mark.parametrize("cls", [ReplicatedEngine, SplitEngine])
def test_rank_zeros_engines_implement_every_call_themselves(cls):
    """Real methods, no forwarding by name: each member is defined on the class or a base
    of it in the server (`ranks.reads.RankZeroReads`, the reads both share)."""
    defined = set().union(*(vars(k) for k in cls.__mro__ if k is not object))
    missing = sorted(_protocol_members() - defined)
    assert not missing
    assert "__getattr__" not in defined


class _Channel:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, call: tuple) -> None:
        self.sent.append(call[0])


class _Share:
    world = 1

    @staticmethod
    def describe_share() -> str:
        return "one rank"


class _LocalEngine:
    """Stands in for rank 0's `Engine`: records which methods ran."""

    parallel = _Share()

    def __init__(self) -> None:
        self.ran: list[str] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.ran.append(name)
            return SimpleNamespace(logprobs=None)  # what compute_logprobs reads

        return call


ARGUMENTS: dict[str, tuple] = {"add_adapter": ("a", LoraSpec(rank=1, alpha=1.0)),
                               "sample_batch": ([],), "decode": ([], [], 0.1)}
"""Arguments the replicated engine reads before it sends a call (every other argument
is passed as None)."""


@pytest.mark.parametrize("name", sorted(_protocol_members() - PROPERTIES))
def test_the_replicated_engine_sends_exactly_the_replicated_calls(name):
    channel, local = _Channel(), _LocalEngine()
    engine = ReplicatedEngine(local, channel, timeout_s=3600)  # type: ignore[arg-type]
    try:
        required = [p for p in list(inspect.signature(getattr(EngineAPI, name))
                                    .parameters.values())[1:]
                    if p.default is inspect.Parameter.empty]
        getattr(engine, name)(*ARGUMENTS.get(name, (None,) * len(required)))
    finally:
        engine.close()
    sent = channel.sent[:-1]  # close sends the stop
    if name in REPLICATED:
        assert len(sent) == 1 and sent[0] in REPLICATED, (name, sent)
        assert local.ran == sent
    else:
        assert sent == [], f"{name} is @rank_zero_only but was sent to every rank"
        assert local.ran == [name]
