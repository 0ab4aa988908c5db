"""Sampler checkpoints kept loaded for sampling, least recently used evicted first.

A sampling session on a saved sampler checkpoint routes its rows to an adapter built
from that checkpoint's files. Loading one reads and checks its weights, so the engine
keeps the last `size` of them attached to the base, and more while one batch routes
more: a checkpoint evicted before its rows ran would leave them on the bare base. The key is the checkpoint's real
path plus its weights file's modification time and size: weights saved over a cached
checkpoint are loaded afresh, never served stale.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

from twinkle_server.engine import checkpoint
from twinkle_server.engine.adapter import Adapter

SAMPLER_CACHE_SIZE = 8
_PREFIX = "sampler:"


def sampler_key(weights_path: str | os.PathLike) -> str:
    """The cache key (and routing id) of the sampler checkpoint at `weights_path`, as its
    files are now."""
    path = os.path.realpath(weights_path)
    try:
        found = os.stat(os.path.join(path, checkpoint.WEIGHTS_FILE))
    except OSError:
        return f"{_PREFIX}{path}@missing"
    return f"{_PREFIX}{path}@{found.st_mtime_ns}:{found.st_size}"


class SamplerCache:
    """Loaded sampler checkpoints by key, most recently used last.

    `load(key, path)` builds and attaches a checkpoint's adapter on a miss; `detach(key,
    adapter)` takes an evicted one off the base; `pinned()` names the keys rows still
    decoding route to, which are never evicted.
    """

    def __init__(self, load: Callable[[str, str], Adapter],
                 detach: Callable[[str, Adapter], None], size: int = SAMPLER_CACHE_SIZE,
                 pinned: Callable[[], set[str]] = set) -> None:
        self._load = load
        self._detach = detach
        self._pinned = pinned
        self.size = size
        self._adapters: OrderedDict[str, Adapter] = OrderedDict()

    def __contains__(self, weights_path: str | os.PathLike) -> bool:
        return sampler_key(weights_path) in self._adapters

    def dirs(self) -> set[str]:
        """The directories (real paths) of the checkpoints loaded now."""
        return {key.removeprefix(_PREFIX).rsplit("@", 1)[0] for key in self._adapters}

    def route(self, weights_path: str) -> str:
        """The routing id of the checkpoint at `weights_path`, loading it on a miss. Nothing
        is evicted until `trim`: a decode batch may route more checkpoints than `size`."""
        key = sampler_key(weights_path)
        if key in self._adapters:
            self._adapters.move_to_end(key)
            return key
        self._adapters[key] = self._load(key, weights_path)
        return key

    def trim(self) -> None:
        """Evict the least recently used checkpoints beyond `size` (after a batch), but
        none that is pinned."""
        pinned = self._pinned()
        for key in [k for k in self._adapters if k not in pinned]:
            if len(self._adapters) <= self.size:
                return
            self._detach(key, self._adapters.pop(key))
