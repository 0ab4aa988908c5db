"""Admission to the decode pool: which waiting requests join the running batch, within
the pool's KV bound. Pure functions of sizes; no torch.

A row of a batch of width W with r tokens left to draw occupies at most W + r positions
until it leaves (the width grows one column per step while r shrinks by one), so the sum
over rows of W + r (`footprint`) bounds what the batch can come to hold. A position is
one column of every attention layer; a row's `RowCost` counts the layers of a sliding
window at the columns they keep, and a hybrid's recurrent states at their size. While every
request has the same number of samples, two or more, the batch may also hold one copy
per request of the columns its rows share (`copies`: `KVBatch.shared_prefix`, which
saves reading a prompt once per sample); that stays the same from step to step. A request
joins only while both, with the cached session prefixes, stay within the pool's capacity;
the rest wait, in order. A request that could not fit in an empty pool is refused at
once; one that fits there without its copy joins an empty pool, and its rows then read
their own caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twinkle_server.engine.errors import ResourceExhausted
from twinkle_server.engine.types import SampleRequest


@dataclass(frozen=True)
class RowCost:
    """KV positions a row of a given length takes: of `layers` attention layers,
    `windowed` hold at most `window` columns a row (a sliding window's W - 1 and the
    spare columns a step writes into), the others every column; its recurrent states
    count as `state` positions. The default: every column of every layer, no state.
    A prefill's forward computes a window's layers over the whole prompt, as every layer,
    before the join keeps only the window: that is the forward's working memory, not
    what the pool holds."""

    state: int = 0
    windowed: int = 0
    layers: int = 1
    window: int = 0

    def positions(self, length: int) -> int:
        """A row of `length` columns (its width and the tokens it has left to draw)."""
        columns = ((self.layers - self.windowed) * length
                   + self.windowed * min(length, self.window))
        return -(-columns // self.layers) + self.state


PLAIN = RowCost()


@dataclass(frozen=True)
class Waiting:
    """What admission needs to know of a waiting request."""

    rows: int
    cached: int     # prompt tokens its prefix entry already holds
    suffix: int     # prompt tokens it must compute
    max_tokens: int


def footprint(width: int, remaining: Sequence[int], cost: RowCost = PLAIN) -> int:
    """Most KV positions rows of a batch of `width`, with `remaining[i]` tokens still to
    draw, can occupy before they leave, each by `cost`."""
    return sum(cost.positions(width + r) for r in remaining)


def copies(samples: Sequence[int], shared: int) -> int:
    """Most KV positions the shared copies of a batch whose requests have `samples[i]`
    samples each, and whose rows hold `shared` columns alike, may take: `shared` a
    request while every request has as many samples, two or more; none otherwise."""
    if len(set(samples)) == 1 and samples[0] >= 2:
        return len(samples) * shared
    return 0


def admit(width: int, remaining: Sequence[int], waiting: Sequence[Waiting], capacity: int,
          prefill_tokens: int, samples: Sequence[int] = (), shared: int = 0,
          cost: RowCost = PLAIN) -> int:
    """How many of `waiting`, in order, join a batch of `width` whose rows have
    `remaining` tokens to draw, within `capacity` KV positions, with room for the shared
    copies (`copies`) of its requests of `samples[i]` samples and `shared` columns alike;
    each row costs `cost`.

    Joiners are prefilled together (or in groups no wider), padded to their widest
    cached prefix plus their widest suffix, and the batch takes the wider width: the rows
    there already hold that many more columns alike, the joiners all of theirs. At most `prefill_tokens` prompt
    tokens are computed per slice, but the first joiner always may (a prompt longer than
    the budget still runs). Stops at the first request that does not fit: it is next.
    """
    count, cached, suffix, computed = 0, 0, 0, 0
    rows, groups = list(remaining), list(samples)
    for request in waiting:
        new_cached, new_suffix = max(cached, request.cached), max(suffix, request.suffix)
        new_width = max(width, new_cached + new_suffix)
        new_rows = rows + [request.max_tokens] * request.rows
        new_groups = groups + [request.rows]
        alike = min(shared + new_width - width, new_width) if remaining else new_width
        need = footprint(new_width, new_rows, cost)
        alone = not remaining and not count     # an empty pool takes one without its copy
        if need > capacity or (need + copies(new_groups, alike) > capacity and not alone):
            break
        if count and computed + request.suffix > prefill_tokens:
            break
        count, cached, suffix, rows, groups = (count + 1, new_cached, new_suffix, new_rows,
                                               new_groups)
        computed += request.suffix
    return count


def never_fits(request: SampleRequest, capacity: int,
               cost: RowCost = PLAIN) -> ResourceExhausted | None:
    """The refusal of a request too large for an empty pool, else None; each of its rows
    costs `cost`."""
    length = request.prompt.size + request.params.max_tokens
    need = request.num_samples * cost.positions(length)
    if need <= capacity:
        return None
    what, row = "prompt + max_tokens", f"{request.prompt.size} + {request.params.max_tokens}"
    if cost.windowed:
        what = (f"the KV positions of prompt + max_tokens, {cost.windowed} of {cost.layers} "
                f"attention layers holding at most {cost.window} columns")
        row = str(cost.positions(length) - cost.state)
    if cost.state:
        what, row = f"{what} + the recurrent layers' state", f"{row} + {cost.state}"
    return ResourceExhausted(
        f"num_samples x ({what}): {request.num_samples} x ({row}) = {need} KV positions, "
        f"over the sampler's pool of {capacity} (--kv-pool-tokens); ask fewer samples or "
        "tokens per request")
