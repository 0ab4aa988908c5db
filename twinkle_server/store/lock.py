"""The data dir's owner: one server at a time, by an exclusive `flock` on `.lock` in it.

A server's start cleans what no earlier process can still use (sampler snapshots, trace
exports, adapter pages) and rewrites `served.json`; a second server on a live server's
data dir would delete the first one's files. So the server takes the lock before any of
that and holds it while it lives; the kernel drops it when the process ends, however it
ends, so a crash leaves no stale lock. The file records the holder's pid and whether it
serves open (no API keys), for the refusals of a second server and of `keys create`.

Whether a server serves open is decided once, at its start, from whether the store holds
a key. A `keys create` beside it must not interleave with that decision (checked before a
server decided open, then written after it read no key, it would leave an open server
beside a key): both run under `keys_settled`, a second lock each holds for milliseconds.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

LOCK_FILE = ".lock"
KEYS_LOCK_FILE = ".keys.lock"


class DataDirInUse(Exception):
    """Another live process holds the data dir; the message names it."""


@dataclass(frozen=True)
class Holder:
    pid: int | None         # None: it took the lock an instant ago, has not written it yet
    open_mode: bool | None  # it serves with no API keys (anyone on loopback, as `local`);
                            # None: not decided yet (it will see every key made before)


class DataDirLock:
    """The data dir's lock, held from `take` until `release` or the process's end."""

    def __init__(self, data_dir: Path, handle: IO[str]) -> None:
        self.data_dir = data_dir
        self._handle = handle

    @classmethod
    def take(cls, data_dir: str | Path) -> DataDirLock:
        """Own `data_dir`; raises DataDirInUse while another process holds it."""
        data_dir = Path(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        handle = open(data_dir / LOCK_FILE, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            held = holder(data_dir)
            raise DataDirInUse(f"data dir {data_dir} is in use by pid "
                               f"{held.pid if held and held.pid else '?'} (a server): stop "
                               "it, or give this one another --data-dir") from None
        lock = cls(data_dir, handle)
        lock.record(open_mode=None)   # until the server has read whether it has keys
        return lock

    def record(self, open_mode: bool | None) -> None:
        """Write who holds the lock, and whether it serves open."""
        self._handle.truncate(0)
        self._handle.write(json.dumps({"pid": os.getpid(), "open": open_mode}))
        self._handle.flush()

    def release(self) -> None:
        self._handle.close()


def holder(data_dir: str | Path) -> Holder | None:
    """Who holds `data_dir`'s lock now, or None when nobody does."""
    path = Path(data_dir) / LOCK_FILE
    try:
        handle = open(path)
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None   # free: the record, if any, is a stopped server's
        except BlockingIOError:
            pass
        try:
            record = json.loads(handle.read())
        except ValueError:   # taken an instant ago, not yet recorded: not decided
            return Holder(None, None)
        return Holder(record["pid"], record["open"])


@contextmanager
def keys_settled(data_dir: str | Path) -> Iterator[None]:
    """Exclusive, blocking: held while a starting server reads whether the store has a key
    and records its decision, and while `keys create` reads that record and writes its key,
    so neither happens in the middle of the other."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / KEYS_LOCK_FILE, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
