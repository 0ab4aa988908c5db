"""The decode pool's prefix cache: the KV of earlier prompts (and completions) of a
sampling session, reused when a later prompt of the same session and weights extends one.

Entries are keyed by namespace, (sampling session, weights version), so a prefix never
crosses tenants or weight versions; each namespace keeps its `per_namespace` most recently
used entries. The cache counts the KV positions it holds (`tokens`), which live inside the
pool's capacity: the pool evicts entries (least recently used namespace first) whenever
its rows need the room (`fit`), so the two together never pass the pool's bound.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

PREFIX_ENTRIES_PER_NAMESPACE = 8
"""Prompts kept per sampling session for prefix reuse (least recently used evicted)."""

Namespace = tuple[str, str]
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class Prefix:
    """A cached sequence's KV: `tokens` and per layer keys and values `[1, H, len, D]`."""

    tokens: np.ndarray
    layers: LayerKV


class PrefixCache:
    """Cached prefixes by namespace, least recently used first."""

    def __init__(self, per_namespace: int = PREFIX_ENTRIES_PER_NAMESPACE) -> None:
        self.per_namespace = per_namespace
        self._entries: OrderedDict[Namespace, OrderedDict[bytes, Prefix]] = OrderedDict()
        self.tokens = 0
        """KV positions held by every entry."""

    def lookup(self, namespace: Namespace, prompt: np.ndarray) -> tuple[Prefix | None, int]:
        """The namespace's entry sharing the longest prefix with `prompt`, and how many of
        its tokens are reused: at most all but the prompt's last (whose logits the
        prefill must compute). (None, 0) when nothing is shared."""
        entries = self._entries.get(namespace)
        best, best_len = None, 0
        for key, entry in (entries or {}).items():
            n = min(entry.tokens.size, prompt.size - 1)
            differ = np.flatnonzero(entry.tokens[:n] != prompt[:n])
            common = int(differ[0]) if differ.size else n
            if common > best_len:
                best, best_len = key, common
        if best is None or entries is None:
            return None, 0
        entries.move_to_end(best)
        self._entries.move_to_end(namespace)
        return entries[best], best_len

    def remember(self, namespace: Namespace, tokens: np.ndarray, layers: LayerKV) -> None:
        """Keep `tokens`' KV (copies, one row) under `namespace` as its newest entry."""
        entries = self._entries.setdefault(namespace, OrderedDict())
        self._entries.move_to_end(namespace)
        key = tokens.tobytes()
        if key in entries:
            self.tokens -= entries.pop(key).tokens.size
        entries[key] = Prefix(tokens, layers)
        self.tokens += tokens.size
        while len(entries) > self.per_namespace:
            self.tokens -= entries.popitem(last=False)[1].tokens.size

    def evict_one(self) -> bool:
        """Drop the least recently used entry; False when there is none."""
        while self._entries:
            namespace, entries = next(iter(self._entries.items()))
            if entries:
                self.tokens -= entries.popitem(last=False)[1].tokens.size
                return True
            del self._entries[namespace]
        return False

    def fit(self, room: int) -> None:
        """Evict entries until the cache holds at most `room` positions."""
        while self.tokens > room and self.evict_one():
            pass

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0
