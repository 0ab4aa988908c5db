"""How a pass's datums are shared among ranks (`engine.parallel.share_of`), and the
sharded engine where the ranks' halves of a pass differ; the server on two ranks runs in
tests/server/test_replication.py, against one on one rank."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from twinkle_server.engine.parallel import share_of

from ..numerics import LOSS_RTOL


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


@pytest.mark.integration
@pytest.mark.parametrize("scenario", ["sample_first", "upper_layer_adapter",
                                      "forward_only_rank_in_pieces",
                                      "pass_failing_in_backward", "checkpointed_pass",
                                      "sampling_split",
                                      "pass_headroom"])
def test_two_ranks_agree_with_one_process(scenario, tiny_cache):
    """Scenarios where the ranks' halves of the work differ (tests/engine/
    parallel_scenarios.py): each completes on two ranks, with one process's numbers
    (LOSS_RTOL: the ranks run other GEMM shapes)."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "tests.engine.parallel_scenarios",
                          scenario], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("{"))
    result = json.loads(line)
    np.testing.assert_allclose(result["got"], result["want"], rtol=LOSS_RTOL)
