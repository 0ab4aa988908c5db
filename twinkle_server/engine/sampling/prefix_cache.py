"""The decode pool's prefix cache: the KV of earlier prompts (and completions) of a
sampling session, reused when a later prompt of the same session and weights extends one.

Entries are keyed by namespace, (sampling session, weights version), so a prefix never
crosses tenants or weight versions; each namespace keeps its `per_namespace` most recently
used entries. The cache counts the KV positions it holds (`tokens`), which live inside the
pool's capacity: the pool evicts entries (least recently used namespace first) whenever
its rows need the room (`fit`), so the two together never pass the pool's bound.

An entry holds what a row of its length holds in the pool, and counts as such a row
(`admission.RowCost`; a window's layers with the spare columns a decoding row's buffers
add, which an entry has not): a hybrid's also keeps its recurrent layers' states after
its last token (`Prefix.states`), a sliding window's layers only their last W - 1
positions.
Both hold for the entry's end alone, so on such a model an entry is reused whole or not
at all (`whole`): a later prompt must extend every one of its tokens (the next turn of a
conversation extends the last prompt and its completion), where an entry of full
attention alone gives any prefix it shares.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from twinkle_server.engine.sampling.admission import PLAIN, RowCost
from twinkle_server.engine.sampling.cache_layers import LayerKV, RowStates

PREFIX_ENTRIES_PER_NAMESPACE = 8
"""Prompts kept per sampling session for prefix reuse (least recently used evicted)."""

Namespace = tuple[str, str]


@dataclass(eq=False)
class Prefix:
    """A cached sequence: `tokens`, per attention layer keys and values `[1, H, n, D]`
    (a window's layer: its last positions), and per recurrent layer the states after
    its last token (none for a model of attention alone)."""

    tokens: np.ndarray
    layers: LayerKV
    states: RowStates = field(default_factory=list)


class PrefixCache:
    """Cached prefixes by namespace, least recently used first."""

    def __init__(self, per_namespace: int = PREFIX_ENTRIES_PER_NAMESPACE,
                 cost: RowCost = PLAIN) -> None:
        """`cost`: the KV positions an entry takes, as a row of its length; a model with
        recurrent states or sliding windows reuses its entries only whole."""
        self.per_namespace, self.cost = per_namespace, cost
        self.whole = bool(cost.state or cost.windowed)
        self._entries: OrderedDict[Namespace, OrderedDict[bytes, Prefix]] = OrderedDict()
        self.tokens = 0
        """KV positions held by every entry."""

    def lookup(self, namespace: Namespace, prompt: np.ndarray) -> tuple[Prefix | None, int]:
        """The namespace's entry sharing the longest prefix with `prompt`, and how many of
        its tokens are reused: at most all but the prompt's last (whose logits the
        prefill must compute), and of a `whole` entry all of them or none. (None, 0)
        when nothing is shared."""
        entries = self._entries.get(namespace)
        best, best_len = None, 0
        for key, entry in (entries or {}).items():
            n = min(entry.tokens.size, prompt.size - 1)
            differ = np.flatnonzero(entry.tokens[:n] != prompt[:n])
            common = int(differ[0]) if differ.size else n
            if self.whole and common < entry.tokens.size:
                continue
            if common > best_len:
                best, best_len = key, common
        if best is None or entries is None:
            return None, 0
        entries.move_to_end(best)
        self._entries.move_to_end(namespace)
        return entries[best], best_len

    def remember(self, namespace: Namespace, tokens: np.ndarray, layers: LayerKV,
                 states: RowStates | None = None) -> None:
        """Keep `tokens`' KV and a hybrid's `states` after them (copies, one row) under
        `namespace` as its newest entry."""
        entries = self._entries.setdefault(namespace, OrderedDict())
        self._entries.move_to_end(namespace)
        key = tokens.tobytes()
        if key in entries:
            self.tokens -= self._positions(entries.pop(key))
        entries[key] = Prefix(tokens, layers, states or [])
        self.tokens += self._positions(entries[key])
        while len(entries) > self.per_namespace:
            self.tokens -= self._positions(entries.popitem(last=False)[1])

    def _positions(self, entry: Prefix) -> int:
        return self.cost.positions(entry.tokens.size)

    def evict_one(self, keep: Collection[Prefix] = ()) -> bool:
        """Drop the least recently used entry but those in `keep` (which requests about
        to join reuse: giving them up would free nothing); False when there is none."""
        for namespace, entries in list(self._entries.items()):
            for key, entry in entries.items():
                if entry not in keep:
                    del entries[key]
                    self.tokens -= self._positions(entry)
                    if not entries:
                        del self._entries[namespace]
                    return True
            if not entries:
                del self._entries[namespace]
        return False

    def fit(self, room: int) -> None:
        """Evict entries until the cache holds at most `room` positions."""
        while self.tokens > room and self.evict_one():
            pass

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0
