"""Admission: the worst-case footprint stays within capacity, and the prefill budget."""

from __future__ import annotations

from twinkle_server.engine.sampling.admission import (
    RowCost,
    Waiting,
    admit,
    copies,
    footprint,
)


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


def test_a_windows_layers_count_the_columns_they_keep_and_a_state_its_size():
    # Of 4 attention layers 3 keep at most 10 columns: a row of 50 columns holds
    # (1 x 50 + 3 x 10) / 4 = 20 positions, and its recurrent states 7 more.
    cost = RowCost(state=7, windowed=3, layers=4, window=10)
    assert cost.positions(50) == 27
    assert cost.positions(6) == 6 + 7          # shorter than the window: every column
    assert cost.positions(51) == 28            # (51 + 30) / 4, rounded up
    assert footprint(40, [10, 2], cost) == 27 + cost.positions(42)
    assert RowCost().positions(50) == 50
    # Admission counts a joiner by its cost: two rows of 10 + 90 columns.
    waiting = [Waiting(rows=2, cached=0, suffix=10, max_tokens=90)]
    windows = RowCost(windowed=2, layers=2, window=20)
    assert admit(0, [], waiting, capacity=40, prefill_tokens=100, cost=windows) == 1
    assert admit(0, [], waiting, capacity=39, prefill_tokens=100, cost=windows) == 0
    assert admit(0, [], waiting, capacity=199, prefill_tokens=100) == 0


def test_admission_stops_at_the_prefill_budget_but_always_takes_the_first():
    waiting = [Waiting(1, 0, 50, 1), Waiting(1, 0, 50, 1), Waiting(1, 0, 10, 1)]
    assert admit(0, [], waiting, capacity=10_000, prefill_tokens=30) == 1
    assert admit(0, [], waiting, capacity=10_000, prefill_tokens=100) == 2
    # A cached prefix counts toward the width, not the prefill.
    assert admit(0, [], [Waiting(1, 40, 10, 1), Waiting(1, 0, 10, 1)], capacity=10_000,
                 prefill_tokens=20) == 2


def test_admission_leaves_room_for_the_copies_of_prompts_that_samples_share():
    # Requests of 4 samples each share their prompts' columns: one copy a request.
    assert copies([4, 4], 20) == 40
    assert copies([4, 2], 20) == copies([1], 20) == copies([], 20) == 0
    group = Waiting(rows=4, cached=0, suffix=20, max_tokens=10)
    # An empty pool: 4 x 30 positions, and 20 for the copy; alone, one joins without it.
    assert admit(0, [], [group, group], capacity=140, prefill_tokens=100) == 1
    assert admit(0, [], [group, group], capacity=120, prefill_tokens=100) == 1
    assert admit(0, [], [group, group], capacity=280, prefill_tokens=100) == 2
    assert admit(0, [], [group, group], capacity=279, prefill_tokens=100) == 1
    # A running group of width 25 (4 x (25 + 5) = 120) whose rows hold 20 columns alike:
    # a joiner of 20 is padded to 25 (4 x 35 = 140), and two copies of 20 columns.
    running = dict(samples=[4], shared=20)
    assert admit(25, [5] * 4, [group], capacity=120 + 140 + 40, prefill_tokens=100,
                 **running) == 1
    assert admit(25, [5] * 4, [group], capacity=120 + 140 + 39, prefill_tokens=100,
                 **running) == 0
    # A joiner of another size: no copy is made, none is kept room for.
    pair = Waiting(rows=2, cached=0, suffix=20, max_tokens=10)
    assert admit(25, [5] * 4, [pair], capacity=120 + 70, prefill_tokens=100,
                 **running) == 1
    # A wider joiner (30) pads the running rows by 5 more columns alike: two copies of
    # 25 (the columns all rows then have alike), beside 4 x 35 and 4 x 40.
    wide = Waiting(rows=4, cached=0, suffix=30, max_tokens=10)
    assert admit(25, [5] * 4, [wide], capacity=4 * 35 + 4 * 40 + 2 * 25,
                 prefill_tokens=100, **running) == 1
    assert admit(25, [5] * 4, [wide], capacity=4 * 35 + 4 * 40 + 2 * 25 - 1,
                 prefill_tokens=100, **running) == 0
