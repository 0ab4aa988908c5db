"""`DataLoader`: batches of dataset rows (lists of feature dicts), optionally shuffled.

Padding and tensor conversion happen later (the model's input processor and the wire
codec), so a batch is just the list of the dataset's rows for those indices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from twinkle_client.errors import require_int


class RowSource(Protocol):
    """Anything with a length and integer indexing: a `Dataset`, a list of dicts."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class DataLoader:
    """Iterate a dataset in batches of `batch_size` rows.

    Args:
        dataset: a `Dataset`, a list of rows, or a zero-argument function returning one
            (called once, here).
        batch_size: rows per batch, >= 1.
        shuffle: visit rows in a random order, a new one each epoch.
        seed: with `shuffle`, makes the orders reproducible across runs: epoch `e` uses
            `numpy.random.default_rng([seed, e])`. None draws a seed once per loader.
        drop_last: leave out a last batch smaller than `batch_size`.

    Every `for batch in loader` is one epoch: the first pass is epoch 0, the next epoch 1,
    and so on; `set_epoch(e)` chooses the epoch of the next pass (to resume).

    Example:
        >>> loader = DataLoader(list(range(10)), batch_size=4)
        >>> len(loader), [len(b) for b in loader]
        (3, [4, 4, 2])
    """

    def __init__(self, dataset: RowSource | Callable[[], RowSource], batch_size: int,
                 shuffle: bool = False, seed: int | None = None, drop_last: bool = False
                 ) -> None:
        require_int(batch_size, "batch_size")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed: must be a non-negative int or None, got {seed!r}")
        if callable(dataset) and not hasattr(dataset, "__len__"):
            dataset = dataset()
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ValueError(f"dataset: needs __len__ and __getitem__ (a Dataset or a list), "
                             f"got {type(dataset).__name__}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed if seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch `epoch` (its shuffle order depends only on seed and epoch)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch: must be a non-negative int, got {epoch!r}")
        self.epoch = epoch

    def __len__(self) -> int:
        count = len(self.dataset)
        return count // self.batch_size if self.drop_last else math.ceil(count / self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The row indices of epoch `epoch`, in visiting order."""
        count = len(self.dataset)
        if not self.shuffle:
            return np.arange(count)
        return np.random.default_rng([self.seed, epoch]).permutation(count)

    def __iter__(self) -> Iterator[list[Any]]:
        indices = self.order(self.epoch)
        self.epoch += 1
        return self._batches(indices)

    def _batches(self, indices: np.ndarray) -> Iterator[list[Any]]:
        count = len(indices)
        batches = count // self.batch_size if self.drop_last else math.ceil(count / self.batch_size)
        for batch in range(batches):
            chosen = indices[batch * self.batch_size:(batch + 1) * self.batch_size]
            yield [self.dataset[int(i)] for i in chosen]
