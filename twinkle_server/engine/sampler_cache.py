"""Sampler checkpoints kept loaded for sampling, least recently used evicted first.

A sampling session on a saved sampler checkpoint routes its rows to an adapter built
from that checkpoint's files. Loading one reads and checks its weights, so the engine
keeps the last `size` of them attached to the base, and more while one batch routes
more: a checkpoint evicted before its rows ran would leave them on the bare base.

The key (and routing id) is the checkpoint's real path plus the SHA-256 of its files'
bytes (`adapter_config.json`, then `adapter_model.safetensors`): a checkpoint whose files
change in any way gets a new key, so it is loaded afresh and never served stale. A key of
modification time and size is not enough: a rewrite of the same size keeps the size, and
`os.utime` (or `cp -p`, `rsync -t`, a restore) sets the modification time back.

Hashing on every request would be too slow (a real adapter's weights are hundreds of MB,
and SHA-256 reads 0.5 to 2 GB/s: up to a second a request), so the digest is memoised on
the files' signature: device, inode, size, `mtime_ns` and `ctime_ns` of each. Any write
or rename changes `ctime_ns`, and no user call can set it (only the clock can; `os.utime`
sets the mtime, and sets the ctime to now), so an unchanged signature means the files
were not rewritten and the memoised digest still holds; an atomic save (a new directory
renamed in) also brings new inodes. A request then costs two `stat`s. A rewrite during
the hash or the load is caught by comparing the signature before and after: the digest
is then not memoised, and the loaded adapter is dropped and loaded again.

One gap remains, as in git's "racily clean" index entries: a file's timestamps tick with
the kernel's coarse clock (a jiffy, up to 10 ms, where Linux's multigrain timestamps
are not in force; a second or two on ext3, FAT or some NFS servers), so a rewrite of the same
size in the same tick as the write hashed keeps the whole signature. A digest taken
within `_RACY_WINDOW_NS` of the files' ctime is therefore trusted only until that window
has passed, then hashed once more: such a rewrite is served stale for at most 2 s, never
for good, and a checkpoint sampled right after its save (the usual case) costs two
hashes, not one a request.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

from twinkle_server.engine import checkpoint
from twinkle_server.engine.adapter import Adapter

log = logging.getLogger(__name__)

SAMPLER_CACHE_SIZE = 8
KEY_PREFIX = "sampler:"
"""How every sampler checkpoint's key (`sampler_key`) begins."""
# Digests remembered, by checkpoint directory; an entry is ~200 bytes.
_DIGEST_MEMO_SIZE = 4096
# Loads of one route retried while the files keep changing under them; the last one is
# kept whatever happened, so a file rewritten without pause still samples.
_LOAD_TRIES = 3
_HASH_CHUNK_BYTES = 1 << 20
# How long after the files' last change a digest is trusted only provisionally: the
# coarsest file timestamp granularity in use (FAT's 2 s; see the module docstring).
_RACY_WINDOW_NS = 2_000_000_000
_FILES = (checkpoint.CONFIG_FILE, checkpoint.WEIGHTS_FILE)

# One file's identity: (device, inode, size, mtime_ns, ctime_ns), or None when absent.
_FileSignature = tuple[int, int, int, int, int] | None


class _Identity(NamedTuple):
    """A checkpoint as its files are now: its real path, key and files' signature."""
    path: str
    key: str
    signature: tuple[_FileSignature, ...]


class _Loaded(NamedTuple):
    """A cached checkpoint: its directory (real path) and its attached adapter."""
    path: str
    adapter: Adapter


class _Digest(NamedTuple):
    """A memoised digest: the signature it was taken under, and from when (a clock
    time in ns) it must be taken again, or None once the files had settled."""
    signature: tuple[_FileSignature, ...]
    digest: str
    recheck_at_ns: int | None


_memo: OrderedDict[str, _Digest] = OrderedDict()
_memo_lock = threading.Lock()
_clock_ns = time.time_ns  # (a seam for tests)


def _file_signature(path: str) -> _FileSignature:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns


def _signature(path: str) -> tuple[_FileSignature, ...]:
    return tuple(_file_signature(os.path.join(path, name)) for name in _FILES)


def _hash_files(path: str) -> str:
    """SHA-256 over the checkpoint's files, each by its length and bytes (absent: -1)."""
    digest = hashlib.sha256()
    for name in _FILES:
        try:
            with open(os.path.join(path, name), "rb") as handle:
                digest.update(name.encode() + b"\0" + os.fstat(handle.fileno()).st_size
                              .to_bytes(8, "little"))
                while chunk := handle.read(_HASH_CHUNK_BYTES):
                    digest.update(chunk)
        except OSError:
            digest.update(name.encode() + b"\0" + (-1).to_bytes(8, "little", signed=True))
    return digest.hexdigest()


def _identify(weights_path: str | os.PathLike) -> _Identity:
    """The checkpoint at `weights_path` as its files are now, hashed only when they changed
    since the last time (see the module docstring)."""
    path = os.path.realpath(weights_path)
    signature = _signature(path)
    if signature[-1] is None:
        return _Identity(path, f"{KEY_PREFIX}{path}@missing", signature)
    with _memo_lock:
        known = _memo.get(path)
        if (known is not None and known.signature == signature
                and (known.recheck_at_ns is None or _clock_ns() < known.recheck_at_ns)):
            _memo.move_to_end(path)
            return _Identity(path, f"{KEY_PREFIX}{path}@{known.digest}", signature)
    hashed_at = _clock_ns()
    digest = _hash_files(path)
    if _signature(path) == signature:  # not rewritten while hashed: the digest holds
        changed = max(found[4] for found in signature if found is not None)
        racy = hashed_at - changed < _RACY_WINDOW_NS
        with _memo_lock:
            _memo[path] = _Digest(signature, digest,
                                  changed + _RACY_WINDOW_NS if racy else None)
            _memo.move_to_end(path)
            while len(_memo) > _DIGEST_MEMO_SIZE:
                _memo.popitem(last=False)
    return _Identity(path, f"{KEY_PREFIX}{path}@{digest}", signature)


def sampler_key(weights_path: str | os.PathLike) -> str:
    """The cache key (and routing id) of the sampler checkpoint at `weights_path`, as its
    files' bytes are now: `sampler:<real path>@<sha256>` (`@missing` without weights)."""
    return _identify(weights_path).key


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
        self._adapters: OrderedDict[str, _Loaded] = OrderedDict()

    def __contains__(self, weights_path: str | os.PathLike) -> bool:
        return sampler_key(weights_path) in self._adapters

    def dirs(self) -> set[str]:
        """The directories (real paths) of the checkpoints loaded now."""
        return {loaded.path for loaded in self._adapters.values()}

    def route(self, weights_path: str) -> str:
        """The routing id of the checkpoint at `weights_path`, loading it on a miss. Nothing
        is evicted until `trim`: a decode batch may route more checkpoints than `size`."""
        for attempt in range(_LOAD_TRIES):
            found = _identify(weights_path)
            if found.key in self._adapters:
                self._adapters.move_to_end(found.key)
                return found.key
            adapter = self._load(found.key, weights_path)
            # Rewritten while hashed or loaded, the adapter may hold other bytes than the
            # key names, and would be served under that key later: load again.
            settled = _signature(found.path) == found.signature
            if settled or attempt == _LOAD_TRIES - 1:
                break
            self._detach(found.key, adapter)
        if not settled:
            log.warning("sampler checkpoint %s kept changing while it loaded; using the "
                        "last load", found.path)
        self._adapters[found.key] = _Loaded(found.path, adapter)
        return found.key

    def trim(self) -> None:
        """Evict the least recently used checkpoints beyond `size` (after a batch), but
        none that is pinned."""
        pinned = self._pinned()
        for key in [k for k in self._adapters if k not in pinned]:
            if len(self._adapters) <= self.size:
                return
            self._detach(key, self._adapters.pop(key).adapter)
