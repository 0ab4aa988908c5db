"""Tinker's `stop` rule, read once for every side that accepts it.

`SamplingParams.stop` in the Tinker API: None keeps stopping at EOS; `[]` disables every
stop, EOS included; a string or a list of strings stops on those texts; a list of ints
stops on those token ids (EOS still stops). The `tinker_compat` client reads its users'
`tinker.types.SamplingParams` with it, the server's HTTP front the stock SDK's JSON.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from twinkle_wire.tensors import WireError


@dataclass(frozen=True)
class Stop:
    """When a sample stops, besides `max_tokens`."""

    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    on_eos: bool = True


def parse_stop(stop: Any, field: str = "sampling_params.stop") -> Stop:
    """Tinker's `stop` (see the module docstring) as a `Stop`; anything else (mixed
    strings and ids, empty strings, negative ids, bools, another type) raises
    `WireError` naming `field`."""
    if stop is None:
        return Stop()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, Sequence) or isinstance(items, bytes):
        raise WireError(f"{field}: expected strings or token ids, got {stop!r}")
    items = list(items)
    if not items:
        return Stop(on_eos=False)
    if all(isinstance(s, str) and s for s in items):
        return Stop(strings=tuple(items))
    if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        return Stop(token_ids=tuple(items))
    raise WireError(f"{field}: expected non-empty strings or non-negative token ids (not "
                    f"mixed), got {stop!r}")
