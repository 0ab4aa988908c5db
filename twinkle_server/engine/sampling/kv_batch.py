"""The decode pool's KV batch: every decoding row's cache in one left-padded batch, with
its attention mask, next positions and pending tokens.

* Layout. Per layer, keys and values `[rows, H, width, D]`, rows left-padded to the
  batch's width (the mask marks real positions), the rows of one adapter contiguous (the
  multi-LoRA router slices by row). Each row carries its last sampled token, not yet fed
  (`pending`): a step feeds that column for every row.
* Steps in place. Keys and values are columns `start:used` of buffers with spare columns
  (`cache_layers.BufferedLayer`, which records both): a step writes its column into the
  buffer, where transformers' `DynamicLayer` would copy the whole cache. `reserve` gives
  the batch new buffers when a step would find no spare column.
* Rows that leave move no other row where they can. `select` copies only the rows whose
  place changes, within the buffers, and `compaction` orders the kept rows so that few
  do: a row that stops is replaced by its route's last row (a request's samples may then
  sit apart: the pool draws them in their own order). The buffers keep their unused rows
  (`unused`, counted in `held`) until a join or a `reserve` replaces them.
* Atomic changes. `join` and `select` build every layer's new tensors before replacing
  any, and a step is undone by `restore(snapshot())`: a forward that fails (out of memory,
  a device error) leaves the batch as it was.
* Shared prompts. A request's rows (its samples) hold the same columns up to the first
  one any row wrote in a step (`start`): its prompt, and padding. While every request
  has the same number of rows (an RL group before any sample stops), `shared_prefix`
  gives those columns once per request, as a copy made after each join or select when
  the pool has room for it (the copy counts in `held`), so that a decode step's
  attention reads them once for all of a request's samples (`decode_attention`), not
  once per sample: the reads a step's attention is bound by.
* Cache layers. What each layer kind holds, and how, is `cache_layers`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from twinkle_server.engine.sampling.cache_layers import (
    BufferedLayer,
    LayerKV,
    RowStates,
    StateRow,
    hold_rows,
    is_kv,
    is_state,
    row_tensors,
    window_columns,
)


def left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """`tensor` with zero columns before its last-but-one (or, 2-D, last) axis up to
    `width`: KV `[B, H, W, D]` along W, masks `[B, W]` along W."""
    axis = tensor.dim() - 2 if tensor.dim() == 4 else tensor.dim() - 1
    missing = width - tensor.shape[axis]
    if missing <= 0:
        return tensor
    return F.pad(tensor, [0, 0] * (tensor.dim() - 1 - axis) + [missing, 0])


@dataclass(frozen=True)
class SharedPrefix:
    """Columns `:width` of every row, held once per group of rows (a request's samples),
    which have them alike: per cache layer `keys`/`values` `[groups, H, width, D]` (None
    for a layer that holds no keys, or a window's that no longer holds the batch's
    first columns: its rows read their own). Every group has `samples` rows, and rows
    `g * samples ...` are group g's."""

    width: int
    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    samples: int

    @property
    def groups(self) -> int:
        return next(k for k in self.keys if k is not None).shape[0]


class KVBatch:
    """The decoding rows' cache (`cache`, a `DynamicCache` of `BufferedLayer`s and
    `StateLayer`s), mask
    `[rows, width]`, next positions `[rows]` and pending tokens `[rows]`; per row its
    group (`group`: a label its request's rows share) and the first column a step wrote
    to it (`start`)."""

    def __init__(self, device: torch.device, row_state: int = 0) -> None:
        self.device = device
        self.row_state = row_state
        """KV positions a row's recurrent states count as (0: the model has none)."""
        self._groups = 0
        self.clear()

    def clear(self) -> None:
        """No rows."""
        device = self.device
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.positions = torch.zeros(0, dtype=torch.long, device=device)
        self.pending = torch.zeros(0, dtype=torch.long, device=device)
        self.group: list[int] = []
        self.start: list[int] = []
        self._forget_shared()

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def layers(self) -> list[Any]:
        """Every cache layer: keys and values, states, or none (`row_tensors`)."""
        return [] if self.cache is None else list(self.cache.layers)

    def kv_layers(self) -> list[BufferedLayer]:
        return [layer for layer in self.layers() if is_kv(layer)]

    def held(self) -> int:
        """KV positions the batch holds now (a position: one column of every attention
        layer, so a window's layer holding fewer columns counts its share): the rows'
        (`buffered`) and the shared copy's groups x columns."""
        shared = self._shared
        return self._held(sum(shared.groups * shared.width for k in shared.keys
                              if k is not None) if shared else 0)

    def buffered(self) -> int:
        """KV positions the rows hold now, the shared copy aside: the buffers' rows x
        their columns, with the rows and columns no row uses any more (rows a select
        left unused, columns it dropped on the left, spare columns sized for rows that
        left: all held until a join or a `reserve` replaces the buffers), and
        `row_state` positions a row for its recurrent states."""
        return self._held(0)

    def _held(self, copied: int) -> int:
        """`buffered`, with `copied` more columns of the attention layers."""
        layers = self.kv_layers()
        if not layers:
            return 0
        return (_positions(sum(layer.rows_held() * layer.columns() for layer in layers)
                           + copied, len(layers)) + self.rows * self.row_state)

    def unused(self) -> int:
        """KV positions of buffer rows a select left unused (until a join or a reserve
        replaces the buffers): held, though no row counts them."""
        layers = self.kv_layers()
        return _positions(sum((layer.rows_held() - self.rows) * layer.columns()
                              for layer in layers), len(layers)) if layers else 0

    @property
    def shared(self) -> SharedPrefix | None:
        """The shared copy held now, if any (`shared_prefix` makes it)."""
        return self._shared

    def shared_width(self) -> int:
        """Columns every row has alike: those before the first a step wrote to any row
        (what a shared copy holds of each group)."""
        return min(self.start, default=0)

    def _forget_shared(self) -> None:
        """Drop the shared copy: the rows changed, `shared_prefix` decides again."""
        self._shared: SharedPrefix | None = None
        self._shared_decided = False

    def join(self, cache: DynamicCache, mask: torch.Tensor, positions: torch.Tensor,
             pending: torch.Tensor, order: Sequence[int] | None = None,
             groups: Sequence[int] | None = None) -> None:
        """Append new rows (their cache, mask, next positions, pending tokens, and labels
        equal for the rows of one request: `groups`, default one group a row), both sides
        padded to the wider, with every row in `order` (the pool's grouping, which keeps a
        group's rows together). All of it is built before anything changes."""
        labels = list(range(len(pending))) if groups is None else list(groups)
        fresh = {label: self._groups + i for i, label in enumerate(dict.fromkeys(labels))}
        new_groups = [fresh[label] for label in labels]
        if self.cache is None:
            layers = [row_tensors(layer) for layer in cache.layers]
            rest = (mask, positions, pending)
            group, start = new_groups, [mask.shape[1]] * len(new_groups)
        else:
            width = max(self.width, mask.shape[1])
            layers = [tuple(_joined(old, o, n) for o, n in zip(row_tensors(old),
                                                               row_tensors(new), strict=True))
                      for old, new in zip(self.layers(), cache.layers, strict=True)]
            rest = (torch.cat([left_pad(self.mask, width), left_pad(mask, width)]),
                    torch.cat([self.positions, positions]), torch.cat([self.pending, pending]))
            group = self.group + new_groups
            start = [s + width - self.width for s in self.start] + [width] * len(new_groups)
        if order is not None and list(order) != list(range(len(group))):
            index = torch.tensor(list(order), dtype=torch.long, device=self.device)
            layers = [tuple(t[index] for t in tensors) for tensors in layers]
            rest = tuple(t[index] for t in rest)
            group, start = [group[i] for i in order], [start[i] for i in order]
        unused = _unused_left(rest[0])
        # Everything is built: from here on nothing allocates, so a failure above left the
        # batch as it was.
        if self.cache is None:
            self.cache = cache
        self._groups += len(fresh)
        self._forget_shared()
        self.mask, self.positions, self.pending = rest
        self.group, self.start = group, start
        for layer, tensors in zip(self.layers(), layers, strict=True):
            hold_rows(layer, tensors)
        for layer in self.kv_layers():
            layer.offset = self.width - layer.keys.shape[-2]
        self._drop_left(unused)

    @torch.inference_mode()
    def select(self, keep: Sequence[int]) -> None:
        """Keep rows `keep`, in that order, and drop padding columns no kept row uses.
        Only a row whose place changes is copied, within the buffers: keeping `keep[i]`
        at `i` costs nothing where they are equal (`rows.compaction` picks such orders).
        Everything that allocates runs before anything changes. In inference mode, as the
        pool's steps made the buffers: a cancel outside a step selects too."""
        if not keep:
            self.clear()
            return
        device = self.device
        index = torch.tensor(list(keep), dtype=torch.long, device=device)
        moves = [(to, row) for to, row in enumerate(keep) if to != row]
        moving = torch.tensor([row for _, row in moves], dtype=torch.long, device=device)
        to = torch.tensor([at for at, _ in moves], dtype=torch.long, device=device)
        mask, positions, pending = self.mask[index], self.positions[index], self.pending[index]
        lifted = [layer.lift(index, moving) if is_kv(layer)
                  else tuple(t[index] for t in row_tensors(layer)) for layer in self.layers()]
        for layer, tensors in zip(self.layers(), lifted, strict=True):
            if is_kv(layer):
                layer.settle(tensors, to, len(keep))
            else:
                hold_rows(layer, tensors)
        self.mask, self.positions, self.pending = mask, positions, pending
        self.group = [self.group[i] for i in keep]
        self.start = [self.start[i] for i in keep]
        self._forget_shared()
        self._drop_left(_unused_left(self.mask))

    def _drop_left(self, columns: int) -> None:
        """Forget the first `columns` columns, which no row uses (views: nothing copied)."""
        if columns:
            for layer in self.kv_layers():
                layer.drop_left(columns)
            self.mask = self.mask[:, columns:]
            self.start = [max(s - columns, 0) for s in self.start]

    def shared_prefix(self, room: int) -> SharedPrefix | None:
        """The columns every row's group has alike (up to the first a step wrote to any
        row), once per group; None unless every group has the same number of rows, two
        or more, such columns are left, and their copy (groups x columns) fits in `room`
        KV positions. Decided at the first call after a join or select, and kept until
        the next.

        Uneven groups (once some request's samples have stopped) read their own caches:
        there the rows' selection has just copied the whole cache, so it is read warm,
        and stacking uneven groups cost more than the reads it saved (BENCHMARKS.md,
        "Limits")."""
        if not self._shared_decided and self.rows:
            self._shared_decided = True
            self._shared = self._make_shared(room)
        return self._shared

    def _make_shared(self, room: int) -> SharedPrefix | None:
        width = self.shared_width()
        size = 1
        while size < self.rows and self.group[size] == self.group[0]:
            size += 1
        if size < 2 or not width or self.rows % size or self.rows // size * width > room:
            return None
        groups = self.group[::size]
        if len(set(groups)) != len(groups) or any(
                self.group[i] != groups[i // size] for i in range(self.rows)):
            return None
        lead = torch.arange(0, self.rows, size, device=self.device)
        layers = self.layers()
        whole = [is_kv(layer) and not layer.offset for layer in layers]
        if not any(whole):
            return None
        return SharedPrefix(width, [layer.keys[lead, :, :width] if kv else None
                                    for layer, kv in zip(layers, whole, strict=True)],
                            [layer.values[lead, :, :width] if kv else None
                             for layer, kv in zip(layers, whole, strict=True)], size)

    def reserve(self, extra: int) -> None:
        """Give every layer `extra` spare columns when some layer has none left, so that
        the next steps write in place; a window's layers keep only their window in the
        new buffers (`BufferedLayer.trim`)."""
        layers = self.kv_layers()
        if all(layer.spare() for layer in layers):
            return
        offsets = [layer.offset for layer in layers]
        for layer in layers:
            layer.trim()
            layer.hold(layer.keys, layer.values, extra)
        if [layer.offset for layer in layers] != offsets:
            self._forget_shared()   # a window's columns moved: its copy is no longer theirs

    def snapshot(self) -> tuple[Any, ...]:
        """What `restore` needs to undo a step (a state layer's own `checkpoint`: from
        here on its step writes into copies)."""
        return (self.mask, self.positions, self.pending,
                [layer.state() if is_kv(layer) else layer.checkpoint() if is_state(layer)
                 else () for layer in self.layers()])

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        self.mask, self.positions, self.pending, layers = snapshot
        for layer, state in zip(self.layers(), layers, strict=True):
            if is_kv(layer):
                layer.set_state(state)
            else:
                hold_rows(layer, state)

    def step_inputs(self) -> dict[str, torch.Tensor]:
        """The next step's forward inputs; the mask takes the new column."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=-1)
        return {"input_ids": self.pending[:, None], "attention_mask": self.mask,
                "position_ids": self.positions[:, None]}

    def advance(self, chosen: torch.Tensor) -> None:
        """After a step: every row moves one position on, `chosen` its pending tokens."""
        self.positions = self.positions + 1
        self.pending = chosen

    def row_prefix(self, row: int) -> tuple[LayerKV, RowStates]:
        """Row `row`'s KV at the positions its mask keeps (a window's layer: the last
        W - 1 of them), as `[1, H, n, D]` copies (a view would keep the whole batch's
        tensors alive), and its recurrent states: a prefix cache entry."""
        return row_kv(self.cache, row, self.mask[row]), row_states(self.cache, row)


def compaction(routes: Sequence[Any], keep: Sequence[int]) -> list[int]:
    """An order for `KVBatch.select` of rows `keep` (ascending) of a batch whose rows'
    routes are `routes` (each route's rows contiguous): routes stay contiguous and in
    their order, and within each route's new run a kept row that is already inside it
    stays where it is, the others filling the places left by rows that go, in order.
    So a row that stops costs one row moved per route after it, where keeping the order
    copied every row after it. A request's rows may end up apart and out of order; the
    pool draws each in its sample order (`tokens.Segment`)."""
    kept = set(keep)
    order: list[int] = []
    start = 0
    while start < len(routes):
        end = start
        while end < len(routes) and routes[end] == routes[start]:
            end += 1
        rows = [row for row in range(start, end) if row in kept]
        first, last = len(order), len(order) + len(rows)
        staying = {row for row in rows if first <= row < last}
        movers = iter(row for row in rows if row not in staying)
        order += [at if at in staying else next(movers) for at in range(first, last)]
        start = end
    return order


def _joined(layer: Any, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """`layer`'s rows `old` and the joiners' `new` as one tensor: states stacked; keys
    and values right-aligned at the batch's last column, as many columns as the wider
    side holds, and a window's layer no more than it keeps (`window_columns`)."""
    if not is_kv(layer):
        return torch.cat([old, new])
    columns = max(old.shape[-2], new.shape[-2])
    if layer.window is not None:
        columns = min(columns, window_columns(layer.window))
    return torch.cat([left_pad(t[..., -columns:, :], columns) for t in (old, new)])


def _positions(columns: int, layers: int) -> int:
    """`columns` summed over `layers` attention layers, in KV positions (rounded up)."""
    return -(-columns // layers)


def _unused_left(mask: torch.Tensor) -> int:
    """How many leading columns of `mask` `[rows, width]` no row uses."""
    used = torch.nonzero(mask.any(0))
    return int(used[0]) if used.numel() else mask.shape[1]


def row_kv(cache: DynamicCache, row: int, mask_row: torch.Tensor) -> LayerKV:
    """Row `row` of `cache` at the positions `mask_row` (the batch's width) keeps, as
    `[1, H, n, D]` copies: of a window's layer, its last W - 1 positions, all a later
    position's window reads."""
    kv = []
    for layer in cache.layers:
        if not is_kv(layer):
            continue
        columns = torch.nonzero(mask_row[layer.offset:]).squeeze(-1)
        if layer.window is not None:
            columns = columns[-window_columns(layer.window):]
        kv.append((layer.keys[row:row + 1, :, columns], layer.values[row:row + 1, :, columns]))
    return kv


def row_states(cache: DynamicCache, row: int) -> RowStates:
    """Row `row`'s states in each recurrent layer of `cache`, as copies (none for a model
    of attention alone)."""
    return [layer.row(row) for layer in cache.layers if is_state(layer)]


def select_rows(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep rows `index` of `cache` (a prefill's), in that order."""
    for layer in cache.layers:
        hold_rows(layer, tuple(t[index] for t in row_tensors(layer)))


def prefix_states(prefixes: Sequence[RowStates | None],
                  cached: Sequence[int]) -> list[list[StateRow]]:
    """Per recurrent layer, each joiner's states at its cached prefix's end (a joiner with
    none starts from zero states, as a fresh layer would); none for a model of attention
    alone."""
    shape = next((p for p, n in zip(prefixes, cached, strict=True) if n and p), None)
    if shape is None:
        return []
    return [[own[layer] if own is not None and n else
             tuple(None if t is None else torch.zeros_like(t) for t in like)
             for own, n in zip(prefixes, cached, strict=True)]
            for layer, like in enumerate(shape)]


def prefix_batch(prefixes: Sequence[LayerKV | None], cached: Sequence[int],
                 width: int) -> LayerKV:
    """Per layer, the first `cached[i]` positions of each joiner's cached prefix as one
    batch `[n, H, width, D]`, right-aligned (a joiner with none is all padding). A
    window's layer holds the last positions of a prefix reused whole, right-aligned
    too, and zeros before them: a window no new position reaches back to."""
    shape = next(p for p, n in zip(prefixes, cached, strict=True) if n and p is not None)
    layers = []
    for layer, (keys, values) in enumerate(shape):
        parts = [[left_pad((own[layer][which] if own is not None and n else like)[..., :n, :],
                           width) for own, n in zip(prefixes, cached, strict=True)]
                 for which, like in ((0, keys), (1, values))]
        layers.append((torch.cat(parts[0]), torch.cat(parts[1])))
    return layers
