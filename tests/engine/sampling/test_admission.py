"""Admission: the worst-case footprint stays within capacity, and the prefill budget."""

from __future__ import annotations

from twinkle_server.engine.sampling.admission import Waiting, admit, footprint


def test_admission_keeps_the_worst_case_footprint_within_capacity():
    # A batch of width 10 whose two rows have 5 and 1 tokens left: 15 + 11 positions.
    assert footprint(10, [5, 1]) == 26
    waiting = [Waiting(rows=2, cached=0, suffix=4, max_tokens=6),
               Waiting(rows=1, cached=0, suffix=20, max_tokens=1)]
    # The first joiner: width stays 10, two rows of 10 + 6 each: 26 + 32 = 58.
    assert admit(10, [5, 1], waiting, capacity=58, prefill_tokens=100) == 1
    assert admit(10, [5, 1], waiting, capacity=57, prefill_tokens=100) == 0
    # The second widens the batch to 20 for every row: 25 + 21 + 2 x 26 + 21 = 119.
    assert admit(10, [5, 1], waiting, capacity=119, prefill_tokens=100) == 2
    assert admit(10, [5, 1], waiting, capacity=118, prefill_tokens=100) == 1


def test_admission_stops_at_the_prefill_budget_but_always_takes_the_first():
    waiting = [Waiting(1, 0, 50, 1), Waiting(1, 0, 50, 1), Waiting(1, 0, 10, 1)]
    assert admit(0, [], waiting, capacity=10_000, prefill_tokens=30) == 1
    assert admit(0, [], waiting, capacity=10_000, prefill_tokens=100) == 2
    # A cached prefix counts toward the width, not the prefill.
    assert admit(0, [], [Waiting(1, 40, 10, 1), Waiting(1, 0, 10, 1)], capacity=10_000,
                 prefill_tokens=20) == 2
