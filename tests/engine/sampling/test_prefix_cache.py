"""The prefix cache: longest shared prefix within a namespace, an exact token count, and
eviction down to the room it is given."""

from __future__ import annotations

import numpy as np
import torch

from twinkle_server.engine.sampling.admission import RowCost
from twinkle_server.engine.sampling.prefix_cache import PrefixCache


def _kv(n):
    return [(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4))]


def test_lookup_reuses_the_longest_shared_prefix_but_never_the_last_prompt_token():
    cache = PrefixCache()
    cache.remember(("s", "v1"), np.arange(10), _kv(10))
    cache.remember(("s", "v1"), np.arange(4), _kv(4))
    entry, reused = cache.lookup(("s", "v1"), np.arange(12))
    assert entry is not None and entry.tokens.size == 10 and reused == 10
    assert cache.lookup(("s", "v1"), np.arange(10))[1] == 9
    assert cache.lookup(("s", "v2"), np.arange(12)) == (None, 0)
    assert cache.lookup(("t", "v1"), np.arange(12)) == (None, 0)


def test_the_token_count_follows_every_entry_in_and_out():
    cache = PrefixCache(per_namespace=2)
    for n in (3, 5, 7):                 # the third pushes out the first
        cache.remember(("s", "v"), np.arange(n), _kv(n))
    assert cache.tokens == 12
    cache.remember(("s", "v"), np.arange(7), _kv(7))     # the same tokens again
    assert cache.tokens == 12
    cache.remember(("t", "v"), np.arange(2), _kv(2))
    cache.fit(9)                        # the least recently used namespace goes first
    assert cache.tokens == 9 and cache.lookup(("t", "v"), np.arange(3))[1] == 2
    cache.fit(0)
    assert cache.tokens == 0 and not cache.evict_one()


def test_a_hybrids_entries_are_reused_only_whole_and_count_their_states():
    """A recurrent state holds at its entry's end: an entry gives all of its tokens or
    none, and takes its tokens and the state's positions."""
    cache = PrefixCache(cost=RowCost(state=6))
    states = [(torch.zeros(1, 3, 4), torch.zeros(1, 2, 4, 4))]
    cache.remember(("s", "v"), np.arange(10), _kv(10), states)
    assert cache.tokens == 16
    entry, reused = cache.lookup(("s", "v"), np.arange(12))
    assert reused == 10 and entry is not None and entry.states is states
    assert cache.lookup(("s", "v"), np.arange(10)) == (None, 0)       # 9 would be all
    assert cache.lookup(("s", "v"), np.r_[np.arange(8), 0, 0, 0]) == (None, 0)
    cache.remember(("s", "v"), np.arange(4), _kv(4), states)
    assert cache.lookup(("s", "v"), np.arange(10))[1] == 4
    assert cache.tokens == 26
    cache.fit(10)
    assert cache.tokens == 10


def test_a_windowed_models_entries_are_reused_only_whole_and_count_as_its_rows():
    """One of two layers keeps a window of 4: an entry of 10 tokens takes (10 + 4) / 2
    positions, as a row of 10 does, and gives all of its tokens or none."""
    cost = RowCost(windowed=1, layers=2, window=4)
    cache = PrefixCache(cost=cost)
    cache.remember(("s", "v"), np.arange(10), _kv(10))
    assert cache.tokens == cost.positions(10) == 7
    assert cache.lookup(("s", "v"), np.arange(11))[1] == 10
    assert cache.lookup(("s", "v"), np.arange(10)) == (None, 0)
