"""The runtime's plain values, passed between the fronts, the verbs and `Core`: which op
of which model (`OpRef`), a parsed checkpoint path (`CheckpointRef`), a refused op
(`Refusal`), the loaded models and sampling sessions `Core` keeps (`ModelEntry`,
`SamplerEntry`), and the caps on user metadata. No state, no I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from twinkle_server.engine.errors import InvalidArgument
from twinkle_wire import paths

MAX_METADATA_ENTRIES = 64
MAX_METADATA_BYTES = 16 * 1024
"""Caps on user metadata and session tags: they are stored in SQLite and returned with
every run listing, so one request must not be able to bloat either."""


@dataclass(frozen=True)
class OpRef:
    """Which op of which model: the client's `seq_id` orders it (None: unordered) and
    `request_id` names it in logs."""

    model_id: str
    seq_id: int | None
    request_id: str = ""


@dataclass(frozen=True)
class CheckpointRef:
    """A parsed checkpoint path, with the text and field it came from for messages."""

    run_id: str
    kind: str           # "training" or "sampler"
    name: str
    text: str
    field: str = "path"


def checkpoint_ref(text: str, field: str = "path") -> CheckpointRef:
    """A `twinkle://` or `tinker://` checkpoint path, parsed (raises `PathError` naming
    `field`); every front reads checkpoint paths with this."""
    path = paths.parse(text, field)
    return CheckpointRef(path.run_id, path.kind, path.name, text, field)


@dataclass(frozen=True)
class Refusal:
    """A refused op that has taken its seq_id (`Core.refuse`): `error` is the answer to
    give at once; awaiting gives the op's outcome in its turn."""

    error: BaseException
    outcome: asyncio.Future

    def __await__(self):
        return self.outcome.__await__()


@dataclass
class ModelEntry:
    """A loaded adapter: which tenant and session own it, and its base model as the
    client named it."""

    model_id: str
    tenant: str
    session_id: str | None
    base_model: str


@dataclass
class SamplerEntry:
    session_id: str
    tenant: str
    model_id: str | None       # live adapter, or an inflight target's route id
    weights_path: str | None   # sampler checkpoint directory
    base_model: str
    snapshot: bool = False     # weights_path is its own snapshot, deleted with it
    snapshot_of: str | None = None  # a snapshot's: the model whose weights it holds
    last_used: float = 0.0     # time.monotonic() of its creation or latest request's end
    in_flight: int = 0         # its requests running or queued now
    inflight_of: str | None = None  # the model whose inflight target it samples
    model_path: str | None = None   # the checkpoint path it was created from, as named


def check_metadata(values: Mapping[str, str], field: str) -> dict[str, str]:
    """A copy of a string map, refused when over the caps above."""
    out = dict(values)
    size = sum(len(k.encode()) + len(v.encode()) for k, v in out.items())
    if len(out) > MAX_METADATA_ENTRIES or size > MAX_METADATA_BYTES:
        raise InvalidArgument(f"{field}: {len(out)} entries, {size} bytes; at most "
                              f"{MAX_METADATA_ENTRIES} entries and {MAX_METADATA_BYTES} bytes")
    return out
