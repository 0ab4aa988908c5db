"""DataLoader: lengths with and without drop_last, seeded shuffles per epoch, bad arguments."""

from __future__ import annotations

import pytest

from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset

ROWS = [{"i": i} for i in range(10)]


def indices(loader: DataLoader) -> list[list[int]]:
    return [[row["i"] for row in batch] for batch in loader]


@pytest.mark.parametrize("count, batch_size, drop_last, expected", [
    (10, 4, False, [4, 4, 2]),
    (10, 4, True, [4, 4]),
    (8, 4, False, [4, 4]),
    (8, 4, True, [4, 4]),
    (3, 4, True, []),
    (0, 4, False, []),
    (10, 1, False, [1] * 10),
])
def test_len_and_batch_sizes_with_and_without_drop_last(count, batch_size, drop_last, expected):
    loader = DataLoader(ROWS[:count], batch_size=batch_size, drop_last=drop_last)
    assert len(loader) == len(expected)
    assert [len(batch) for batch in loader] == expected


def test_without_shuffle_batches_are_the_rows_in_order_as_lists_of_dicts():
    assert indices(DataLoader(ROWS, batch_size=4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert indices(DataLoader(Dataset.from_rows(ROWS), batch_size=5)) == [[0, 1, 2, 3, 4],
                                                                          [5, 6, 7, 8, 9]]


def test_seeded_shuffle_is_reproducible_across_loaders_and_differs_per_epoch():
    first = DataLoader(ROWS, batch_size=3, shuffle=True, seed=7)
    second = DataLoader(ROWS, batch_size=3, shuffle=True, seed=7)
    epochs = [indices(first) for _ in range(3)]
    assert epochs == [indices(second) for _ in range(3)]
    assert len({str(epoch) for epoch in epochs}) == 3
    for epoch in epochs:
        assert sorted(sum(epoch, [])) == list(range(10))
    assert indices(DataLoader(ROWS, batch_size=3, shuffle=True, seed=8)) != epochs[0]


def test_set_epoch_replays_that_epochs_order():
    loader = DataLoader(ROWS, batch_size=3, shuffle=True, seed=1)
    epochs = [indices(loader) for _ in range(2)]
    loader.set_epoch(1)
    assert indices(loader) == epochs[1]
    assert loader.epoch == 2


def test_shuffle_with_drop_last_drops_only_the_short_tail():
    batches = indices(DataLoader(ROWS, batch_size=4, shuffle=True, seed=3, drop_last=True))
    assert [len(b) for b in batches] == [4, 4] and len(set(sum(batches, []))) == 8


def test_dataset_may_be_a_factory_function_called_once():
    calls = []

    def make():
        calls.append(1)
        return ROWS

    loader = DataLoader(dataset=make, batch_size=5)
    assert len(loader) == 2 and indices(loader)[1] == [5, 6, 7, 8, 9] and calls == [1]


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, "batch_size: must be an int >= 1, got 0"),
    ({"batch_size": -2}, "batch_size: must be an int >= 1, got -2"),
    ({"batch_size": 2.5}, "batch_size: must be an int >= 1, got 2.5"),
    ({"batch_size": True}, "batch_size: must be an int >= 1, got True"),
    ({"batch_size": 2, "seed": -1}, "seed: must be a non-negative int or None"),
])
def test_bad_arguments_name_the_field_and_limit(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DataLoader(ROWS, **kwargs)


def test_a_dataset_without_len_and_indexing_is_refused():
    with pytest.raises(ValueError, match="dataset: needs __len__ and __getitem__"):
        DataLoader(iter(ROWS), batch_size=2)
    with pytest.raises(ValueError, match="epoch: must be a non-negative int"):
        DataLoader(ROWS, batch_size=2).set_epoch(-1)
