"""How a pass's datums are shared among ranks (`engine.parallel.share_of`), and the
sharded engine where the ranks' halves of a pass differ; the server on two ranks runs in
tests/ranks/test_replication.py, against one on one rank."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from twinkle_server.engine.parallel import share_of
from twinkle_server.engine.types import LoraSpec

from ..numerics import LOSS_RTOL
from .draws import assert_sampled_alike, sampled_alone


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_every_datum_goes_to_exactly_one_rank_in_order(world):
    rng = np.random.default_rng(world)
    lengths = rng.integers(1, 1024, 37).tolist()
    shares = [share_of(lengths, rank, world) for rank in range(world)]
    assert [i for share in shares for i in share] == list(range(len(lengths)))


@pytest.mark.parametrize("world", [2, 4])
def test_shares_are_token_balanced_within_one_datum(world):
    rng = np.random.default_rng(7)
    lengths = rng.integers(32, 1024, 64).tolist()
    tokens = [sum(lengths[i] for i in share_of(lengths, r, world)) for r in range(world)]
    assert max(tokens) - min(tokens) <= max(lengths), tokens


def test_a_long_datum_does_not_pull_its_neighbours_along():
    # One 1000-token datum among 1-token ones: it alone fills one rank's half.
    lengths = [1] * 10 + [1000] + [1] * 10
    assert list(share_of(lengths, 0, 2)) == list(range(10))
    assert list(share_of(lengths, 1, 2)) == list(range(10, 21))


def test_with_fewer_datums_than_ranks_some_ranks_get_none():
    shares = [share_of([5, 5], rank, 4) for rank in range(4)]
    assert sorted(len(s) for s in shares) == [0, 0, 1, 1]


ON_TWO_RANKS = ["sample_first", "upper_layer_adapter", "forward_only_rank_in_pieces",
                "pass_failing_in_backward", "checkpointed_pass", "pass_headroom"]
"""Scenarios whose result is a list of losses and gradient sums."""


@pytest.fixture(scope="module")
def two_ranks(tiny_cache) -> dict[str, dict]:
    """Every scenario of tests/engine/parallel_scenarios.py, run in one two-rank job: its
    {"got": two ranks, "want": one process}, by name."""
    from tests.engine.parallel_scenarios import SCENARIOS

    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "tests.engine.parallel_scenarios",
                          *SCENARIOS], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    return {result.pop("scenario"): result for result in results}


@pytest.mark.integration
@pytest.mark.parametrize("scenario", ON_TWO_RANKS)
def test_two_ranks_agree_with_one_process(scenario, two_ranks):
    """Scenarios where the ranks' halves of the work differ (tests/engine/
    parallel_scenarios.py): each completes on two ranks, with one process's numbers
    (LOSS_RTOL: the ranks run other GEMM shapes)."""
    result = two_ranks[scenario]
    np.testing.assert_allclose(result["got"], result["want"], rtol=LOSS_RTOL)


def _alike_alone(engine, add, requests, result) -> None:
    """Each request's rows, on two ranks (`got`) and on one process (`want`), are its rows
    sampled alone up to a near tie (`draws.assert_sampled_alike`): the same seeded draws,
    on logits a rounding apart (each rank's batch has other rows and padding, so other
    GEMM shapes), logprobs within LOGPROB_ATOL up to there. The reference runs in this
    process, on the same tiny model and adapter 's' (made from the same seed)."""
    add("s", LoraSpec(rank=4, alpha=8, seed=6))
    row = 0
    for i, request in enumerate(requests):
        reference = sampled_alone(lambda r=request: engine.sample_batch([r])[0],
                                  request.params)
        for side in ("got", "want"):
            out = result[side]
            rows = [SimpleNamespace(tokens=out["tokens"][j], logprobs=out["logprobs"][j],
                                    stop_reason=out["stop_reasons"][j])
                    for j in range(row, row + request.num_samples)]
            assert_sampled_alike(reference, rows, f"{side}: request {i}")
        row += request.num_samples
    assert row == len(result["got"]["tokens"]) == len(result["want"]["tokens"])


@pytest.mark.integration
def test_two_ranks_sample_their_shares_as_one_process(two_ranks, engine, add):
    """A static batch split into the ranks' shares (`sampling_split`): every request's
    rows as alone, up to a near tie."""
    from tests.engine.parallel_scenarios import sampling_split_requests

    _alike_alone(engine, add, sampling_split_requests(), two_ranks["sampling_split"])


@pytest.mark.integration
def test_two_rank_decode_with_joins_and_leaves_equals_one_rank(two_ranks, engine, add):
    """Continuous batching on two ranks, requests joining a running batch after a few
    slices and leaving at different steps (`decode_with_joins_and_leaves`): every seeded
    request's rows are its rows alone up to a near tie (its own generator, the same
    draws), on two ranks and on one process alike."""
    from tests.engine.parallel_scenarios import DECODE_JOIN_CALL, decode_calls

    result = two_ranks["decode_with_joins_and_leaves"]
    got, want = result["got"], result["want"]
    # Joins and leaves really happened mid-generation: the first call's shortest request
    # was answered before the late ones joined, its longest only after they joined.
    finished = {key: call for call, keys in enumerate(want["finished_by_call"]) for key in keys}
    assert finished[0] < DECODE_JOIN_CALL < finished[1], want["finished_by_call"]
    assert len(got["tokens"]) == len(want["tokens"]) == 9  # 7 requests, two of 2 samples
    assert [len(t) for t in want["tokens"]] == [3, 12, 7, 7, 5, 9, 2, 6, 6]
    calls = decode_calls()
    _alike_alone(engine, add, [r for call in sorted(calls) for r in calls[call]], result)
    # One step per slice on either: each request finishes at the same call.
    assert got["finished_by_call"] == want["finished_by_call"]
