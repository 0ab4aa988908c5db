"""Engine scenarios on several ranks, run by tests/engine/test_parallel.py under torch's
launcher (`python -m torch.distributed.run --nproc-per-node 2 -m
tests.engine.parallel_scenarios NAME...`), one after another in one job (each on engines of
its own: a job's start costs more than most scenarios). Every rank runs the same calls;
rank 0 also runs them on an engine of its own on one process and prints one JSON line per
scenario comparing the two.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from tests.engine.faults import failing_replay
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.errors import ResourceExhausted
from twinkle_server.engine.parallel import Parallel, placement_from_env
from twinkle_server.engine.types import (
    AdamParams,
    Datum,
    EngineLimits,
    ForwardRequest,
    LoraSpec,
    LossSpec,
    SampleRequest,
    SamplingParams,
)

CE = LossSpec("cross_entropy")
LIMITS = EngineLimits(max_seq_len=32, max_pass_tokens=32)


def _datum(seed: int, n: int = 20) -> Datum:
    rng = np.random.default_rng(seed)
    return Datum(rng.integers(3, 4000, n), {"target_tokens": rng.integers(3, 4000, n)})


def sample_first(engine: Engine) -> list[float]:
    """Sampling before any training pass, then training."""
    engine.add_adapter("a", LoraSpec(rank=4, alpha=8, seed=1))
    engine.sample_batch([SampleRequest("a", None, np.array([1, 2, 3]), 1,
                                       SamplingParams(max_tokens=4, seed=3))])
    out = engine.forward_batch([ForwardRequest("a", [_datum(0)], CE, True)])
    return [o.loss for o in out]


def upper_layer_adapter(engine: Engine) -> list[float]:
    """One rank's rows under an adapter on the output layer only, the other's on every
    layer: a merged pass whose two halves reach different depths of the base."""
    engine.add_adapter("x", LoraSpec(rank=4, alpha=8, seed=2, target_modules=("lm_head",)))
    engine.add_adapter("a", LoraSpec(rank=4, alpha=8, seed=1))
    out = engine.forward_batch([ForwardRequest("x", [_datum(1)], CE, True),
                                ForwardRequest("a", [_datum(2)], CE, True)])
    return [o.loss for o in out]


def forward_only_rank_in_pieces(engine: Engine) -> list[float]:
    """A pass in pieces where one rank holds only a forward-only request's rows."""
    engine.add_adapter("f", LoraSpec(rank=4, alpha=8, seed=3))
    engine.add_adapter("b", LoraSpec(rank=4, alpha=8, seed=4))
    out = engine.forward_batch([ForwardRequest("f", [_datum(3, 30)], CE, False),
                                ForwardRequest("b", [_datum(4, 30), _datum(5, 30)], CE, True)])
    grads = [float(p.grad.abs().sum()) for p in engine.adapters["b"].parameters()]
    return [o.loss for o in out] + [sum(grads)]


def pass_failing_in_backward(engine: Engine) -> list[float]:
    """A pass in pieces whose second piece's replay runs out of memory on every rank,
    then the same pass again: the failed one changes nothing, FSDP's units recover. On
    several ranks the error is raised (the server then ends the group); in one process it
    is the request's value."""
    engine.add_adapter("b", LoraSpec(rank=4, alpha=8, seed=4))
    request = [ForwardRequest("b", [_datum(i, 30) for i in range(3)], CE, True)]
    try:
        with failing_replay(MemoryError):
            failed = engine.forward_batch(request)[0]
    except MemoryError:
        failed = ResourceExhausted("raised")
    assert isinstance(failed, ResourceExhausted), failed
    out = engine.forward_batch(request)[0]
    grads = [float(p.grad.abs().sum()) for p in engine.adapters["b"].parameters()]
    return [out.loss, sum(grads)]


def checkpointed_pass(engine: Engine) -> list[float]:
    """Training with activation checkpointing (enabled after FSDP shards the base), one
    rank's rows under an adapter on the output layer only (as `upper_layer_adapter`), two
    passes with a step between."""
    layers = engine.base.model.get_decoder().layers
    assert all(layer.gradient_checkpointing for layer in layers)
    engine.add_adapter("x", LoraSpec(rank=4, alpha=8, seed=2, target_modules=("lm_head",)))
    engine.add_adapter("a", LoraSpec(rank=4, alpha=8, seed=1))
    losses = []
    for _ in range(2):
        out = engine.forward_batch([ForwardRequest("x", [_datum(6)], CE, True),
                                    ForwardRequest("a", [_datum(7)], CE, True)])
        losses += [o.loss for o in out]
        for name in ("x", "a"):
            engine.optim_step(name, AdamParams(learning_rate=1e-2))
    return losses


def sampling_split_requests() -> list[SampleRequest]:
    """`sampling_split`'s requests, on the base and on adapter 's'."""
    return [SampleRequest("s" if i % 2 else None, None, np.arange(3, 3 + 2 + i), 1 + i % 2,
                          SamplingParams(max_tokens=3 + 4 * i, seed=10 + i))
            for i in range(5)]


def sampling_split(engine: Engine) -> dict:
    """A batch of seeded sample requests of different lengths: on several ranks each
    samples its share (the rest idle in step). Returns every row's tokens, logprobs and
    stop reason (tests/engine/test_parallel.py compares them with each request alone)."""
    engine.add_adapter("s", LoraSpec(rank=4, alpha=8, seed=6))
    out = engine.sample_batch(sampling_split_requests())
    assert not any(isinstance(o, Exception) for o in out), out
    return _rows(out)


def _rows(generations) -> dict:
    """The rows of `generations` (each a list of `SampledSequence`s), in order, as JSON."""
    out = {"tokens": [], "logprobs": [], "stop_reasons": []}
    for sequences in generations:
        for seq in sequences:
            out["tokens"].append([int(t) for t in seq.tokens])
            out["logprobs"].append([float(x) for x in seq.logprobs])
            out["stop_reasons"].append(seq.stop_reason)
    return out


def pass_headroom(engine: Engine) -> list[float]:
    """On several ranks the headroom adapter creation keeps free also counts what a pass
    gathers: the root unit (embeddings, norm, output layer) and two decoder layers."""
    if engine.parallel.world > 1:
        return [engine.pass_headroom_bytes]
    model = engine.base.model
    layers = model.get_decoder().layers
    layer = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    return [engine.pass_headroom_bytes + whole - len(layers) * layer + 2 * layer]


DECODE_JOIN_CALL = 4
"""The `decode_with_joins_and_leaves` call at which the late requests join."""


def decode_calls() -> dict[int, list[SampleRequest]]:
    """`decode_with_joins_and_leaves`'s requests, by the call they join at; their keys
    count up in that order."""
    def request(i: int, max_tokens: int, num_samples: int = 1) -> SampleRequest:
        return SampleRequest("s" if i % 2 else None, None, np.arange(5 + i, 5 + i + 3 + i % 4),
                             num_samples, SamplingParams(max_tokens=max_tokens, seed=20 + i,
                                                         ignore_eos=True))

    return {0: [request(0, 3), request(1, 12), request(2, 7, num_samples=2)],
            DECODE_JOIN_CALL: [request(3, 5), request(4, 9), request(5, 2)],
            DECODE_JOIN_CALL + 2: [request(6, 6, num_samples=2)]}


def decode_with_joins_and_leaves(engine: Engine) -> dict:
    """Continuous batching in slices of one step (`slice_s` 0: rank 0's clock ends each
    slice after its first step): seeded requests of different `max_tokens` (rows leave at
    different steps), some joining after a few slices while the first still decode, on
    the base and on an adapter, one with two samples. Returns, by key, each request's
    tokens, logprobs and stop reasons, and the keys each call finished."""
    engine.add_adapter("s", LoraSpec(rank=4, alpha=8, seed=6))
    calls = decode_calls()
    results, finished_by_call, key = {}, [], 0
    for call in range(100):
        new = calls.get(call, [])
        own_keys = list(range(key, key + len(new)))
        key += len(new)
        done = engine.decode(new, own_keys, 0.0)
        finished_by_call.append(sorted(k for k, _ in done))
        for k, generation in done:
            assert not isinstance(generation, Exception), generation
            results[k] = generation
        if call > max(calls) and len(results) == key:
            break
    out = _rows(results[k].sequences for k in sorted(results))
    return {**out, "finished_by_call": finished_by_call}


SCENARIOS = {f.__name__: f for f in (sample_first, upper_layer_adapter,
                                     forward_only_rank_in_pieces, pass_failing_in_backward,
                                     checkpointed_pass,
                                     sampling_split,
                                     decode_with_joins_and_leaves,
                                     pass_headroom)}


OPTIONS = {"checkpointed_pass": {"activation_checkpointing": True}}
"""Engine options of a scenario, on every rank and in the one-process reference."""


def main(names: list[str]) -> None:
    parallel = Parallel.init(placement_from_env("cpu"), timeout_s=60)
    for name in names:
        options = OPTIONS.get(name, {})
        got = SCENARIOS[name](Engine.load("tiny", device="cpu", limits=LIMITS,
                                          parallel=parallel, **options))
        if parallel.rank == 0:
            want = SCENARIOS[name](Engine.load("tiny", device="cpu", limits=LIMITS, **options))
            os.write(1, (json.dumps({"scenario": name, "got": got, "want": want})
                         + "\n").encode())
    parallel.close()
    # The result is out and every rank has left the group: skip the interpreter's
    # teardown. Now and then rank 1 aborted ("terminate called without an active
    # exception", no Python error) while rank 0 was still ending, failing the run; never
    # reproduced alone, it fits a joinable C++ thread destroyed at interpreter exit.
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
