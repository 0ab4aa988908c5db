"""The scheduler's one decision, which ready ops run together, with no scheduler at all."""

from __future__ import annotations

import pytest

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.scheduling.planning import (
    Slots,
    default_token_budget,
    plan_batch,
    plan_cancel,
    plan_work,
)
from twinkle_server.scheduling.scheduler import Op


def fwd(queue, seq, tokens=10):
    return Op(queue, seq, "forward_backward", "forward", tokens, None)


def optim(queue, seq):
    return Op(queue, seq, "optim_step", None, 0, None)


def sample(queue, seq, tokens=10):
    return Op(queue, seq, "sample", "sample", tokens, None)


def test_plan_batch_decisions():
    heads = [fwd("a", 0, 10), fwd("b", 0, 10), optim("c", 0), fwd("d", 0, 30),
             sample("e", 0, 5), fwd("f", 0, 5)]
    assert plan_batch(heads, "merged", 25) == heads[:2] + [heads[5]]  # d skipped, f fits
    assert plan_batch(heads, "merged", 20) == heads[:2]
    assert plan_batch(heads, "timeshare", 1000) == heads[:1]
    assert plan_batch(heads[2:], "merged", 1000) == [heads[2]]  # a lone op leads: alone
    assert plan_batch(heads[4:], "merged", 1000) == [heads[4]]  # sample never joins forward
    assert plan_batch([fwd("a", 0, 100)], "merged", 10) == [fwd("a", 0, 100)]
    assert plan_batch([fwd("a", 0), fwd("a", 1)], "merged", 1000) == [fwd("a", 0)]
    assert plan_batch([], "merged", 10) == []
    with pytest.raises(InvalidArgument, match="scheduling: 'fifo'"):
        plan_batch(heads, "fifo", 10)


def test_plan_batch_starts_at_start_index_and_wraps_around():
    heads = [fwd("a", 0, 10), fwd("b", 0, 10), optim("c", 0), fwd("d", 0, 10)]
    # d leads, then the pass wraps to a; b no longer fits in 20 tokens.
    assert plan_batch(heads, "merged", 20, start_index=3) == [heads[3], heads[0]]
    assert plan_batch(heads, "merged", 1000, start_index=1) == [heads[1], heads[3], heads[0]]
    assert plan_batch(heads, "merged", 1000, start_index=2) == [heads[2]]
    assert plan_batch(heads, "timeshare", 1000, start_index=3) == [heads[3]]
    for bad in (-1, 4):
        with pytest.raises(InvalidArgument, match=f"start_index: {bad} is outside the 4 heads"):
            plan_batch(heads, "merged", 10, start_index=bad)


def run_of(queue, seq=0, tokens=10):
    """A forward op of the run `queue`, whose adapter is the run's own."""
    return Op(queue, seq, "forward_backward", "forward", tokens, None, adapter=queue)


def test_a_merged_batch_takes_resident_adapters_before_ones_that_would_page_in():
    heads = [run_of(q) for q in "abcdef"]
    slots = Slots(3, frozenset({"d", "f"}))
    # a leads (its turn), then the resident d and f; b, c, e would need slots it lacks.
    assert plan_batch(heads, "merged", 1000, slots=slots) == [heads[0], heads[3], heads[5]]
    # With room for four, one adapter pages in: the first in rotation of those out.
    assert plan_batch(heads, "merged", 1000, slots=Slots(4, slots.resident)) == [
        heads[0], heads[3], heads[5], heads[1]]
    # The leading head runs whether or not its adapter is resident: every queue leads in
    # turn, so an adapter paged out waits at most one rotation.
    assert plan_batch(heads, "merged", 1000, start_index=4,
                      slots=slots) == [heads[4], heads[5], heads[3]]


def test_a_merged_batch_holds_at_most_the_slots_adapters_and_ops_sharing_one_join():
    heads = [run_of("a"), run_of("b"), run_of("c"),
             Op("d", 0, "forward_backward", "forward", 10, None, adapter="a"),
             Op("e", 0, "forward_backward", "forward", 10, None)]   # needs no adapter
    slots = Slots(2, frozenset())
    # e needs no adapter and d shares a's: both page nothing in, so they join first.
    assert plan_batch(heads, "merged", 1000, slots=slots) == [heads[0], heads[3], heads[4],
                                                               heads[1]]
    # No slots given: residency is not the planner's concern, every head joins.
    assert plan_batch(heads, "merged", 1000) == heads
    # The token budget still bounds a batch that the slots allow.
    assert plan_batch(heads[:3], "merged", 20, slots=Slots(8, frozenset())) == heads[:2]


def test_an_accelerator_merges_more_tokens_per_pass_than_a_cpu():
    assert default_token_budget("cpu") == 1024
    assert default_token_budget("cuda") == default_token_budget("xpu") == 8192


@pytest.mark.parametrize("training, decoding, joining, last, training_first, expected", [
    (True, True, False, "decode", False, "train"),
    (True, True, True, "train", True, "decode"),
    (True, True, False, None, False, "train"),
    (True, False, True, "train", True, "train"),
    (True, False, True, "train", False, "decode"),
    (True, False, False, "decode", False, "train"),
    (False, True, False, "decode", True, "decode"),
    (False, False, True, "train", True, "decode"),
    (False, False, False, "train", True, None),
])
def test_plan_work_alternates_while_rows_decode_else_goes_by_arrival(
        training, decoding, joining, last, training_first, expected):
    assert plan_work(training, decoding, joining, last, training_first) == expected


@pytest.mark.parametrize(("decode_op", "place", "ordered", "action"), [
    (True, "queued", False, "drop"),     # never runs
    (True, "queued", True, "skip"),      # answered now; its seq_id is taken in its turn
    (True, "joining", False, "drop"),
    (True, "joining", True, "drop"),     # its turn came: it takes its seq_id now
    (True, "pool", False, "stop"),       # the executor ends it at the next slice
    (True, "pool", True, "stop"),
    (True, "done", False, "keep"),
    (False, "queued", True, "keep"),     # a training op runs: later seq_ids build on it
    (False, "queued", False, "keep"),
    (False, "running", True, "keep"),
])
def test_plan_cancel_stops_only_sample_ops_of_the_decode_pool(decode_op, place, ordered,
                                                              action):
    assert plan_cancel(decode_op, place, ordered) == action
