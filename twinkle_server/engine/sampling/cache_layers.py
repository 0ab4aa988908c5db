"""The decode pool's cache layers, one class per kind of layer a model's cache holds: what
each kind keeps per row, and the functions that treat every kind alike.

* Keys and values. Full attention's, and a sliding window's (`BufferedLayer`).
* Recurrent layers. A hybrid's linear-attention and Mamba layers (Qwen3.5, Qwen3-Next,
  Nemotron-H) hold a state of fixed size per row instead of keys and values: the causal
  conv's last inputs and the scan's state (`StateLayer`). They join, leave, are undone
  with a failed step and are held per row like the keys and values, rows first, with no
  width (left padding before a row's tokens leaves its states at zero: padding positions
  enter a prefill zeroed by its mask; a prefill that goes on from a cached prefix's
  states, `StateLayer.start_from`, has no padding after them). A step replaces a layer's
  states rather than writing into them (`StateLayer.checkpoint`), so `snapshot` keeps
  the states before it.
* Sliding windows. A sliding-window layer (Mistral, Gemma 3, gpt-oss) of window W keeps
  the batch's last W - 1 columns whenever it gets new buffers (a join, a `reserve`:
  `BufferedLayer.trim`), so its buffers hold those and the spare columns the next steps
  write, and its memory stops growing with the batch's width. A decode step's mask
  keeps each row's last W positions of what it holds and the new one
  (`decode_attention.decode_mask`): a row's real positions are the last of its columns,
  so its window lies within them. Until its first trim it still holds the batch's first
  columns, and a request's samples read their shared prompt there once. Other local
  attention (chunked) is not held: `unsupported_layers` names it, and the pool refuses
  such a model when it is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

try:
    from transformers.cache_utils import DummyLayer, LinearAttentionLayer
except ImportError:  # before transformers 5.25 a hybrid's states live in its own cache class
    DummyLayer = LinearAttentionLayer = None

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per attention layer, keys and values."""
StateRow = tuple[torch.Tensor | None, ...]
"""One row's states in one recurrent layer, as `StateLayer.row` gives them."""
RowStates = list[StateRow]
"""A row's states, per recurrent layer."""


def window_columns(window: int) -> int:
    """Columns a layer of sliding window `window` keeps between steps: the window but
    the step's own new column."""
    return max(1, window - 1)


class BufferedLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are columns `start:used` of `buffers`
    (keys, values `[B, H, C, D]`) when it has them: `update` writes new columns into the
    buffers in place while they have room, and otherwise concatenates (and drops them).

    A sliding-window layer (`window` W) may hold only the batch's last columns, from
    column `offset` on (`trim` keeps W - 1, which a step's new column completes to the
    window; the batch trims as it makes new buffers, so a window's buffers hold W - 1
    columns and the spare ones): it reports that offset to transformers' masks as its
    own sliding layer does, and the batch's whole width as its length."""

    buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    start = used = 0
    allocated = 0
    """Rows the buffers were made with: a select keeps its rows in their first ones."""
    window: int | None = None
    offset = 0
    """The batch's columns before this layer's first (0 but for a trimmed window)."""

    def get_seq_length(self) -> int:
        return self.offset + super().get_seq_length()

    def get_mask_sizes(self, query: Any, *args: Any) -> tuple[int, int]:
        """Length and offset of the keys a step attends to (`query`: the query's length,
        or before transformers 5.25 its cache positions)."""
        length, _ = super().get_mask_sizes(query, *args)
        return length - self.offset, self.offset

    def trim(self) -> None:
        """A window's layer forgets its columns before its last W - 1 (views: the memory
        goes when `hold` copies them); other layers keep every column."""
        if self.window is None or self.keys is None:
            return
        excess = self.keys.shape[-2] - window_columns(self.window)
        if excess > 0:
            self.keys, self.values = self.keys[..., excess:, :], self.values[..., excess:, :]
            self.offset += excess
            if self.buffers is not None:
                self.start += excess

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        if self.buffers is not None and self.used + n <= self.buffers[0].shape[-2]:
            keys, values = self.buffers
            keys[..., self.used:self.used + n, :] = key_states
            values[..., self.used:self.used + n, :] = value_states
            self.used += n
            self.keys = keys[..., self.start:self.used, :]
            self.values = values[..., self.start:self.used, :]
            return self.keys, self.values
        self.buffers = None
        return super().update(key_states, value_states, *args, **kwargs)

    def spare(self) -> int:
        """Columns a step may still write in place."""
        return 0 if self.buffers is None else self.buffers[0].shape[-2] - self.used

    def columns(self) -> int:
        """Columns held per row: the buffer's, or the keys' own."""
        return self.buffers[0].shape[-2] if self.buffers is not None else self.keys.shape[-2]

    def rows_held(self) -> int:
        """Rows whose memory it holds: the buffers' allocated rows, or the keys' own."""
        return self.allocated if self.buffers is not None else self.keys.shape[0]

    def hold(self, keys: torch.Tensor, values: torch.Tensor, extra: int = 0) -> None:
        """Hold copies of `keys` and `values` as the leading columns of new buffers with
        `extra` spare columns (no buffers when `extra` is 0: plain tensors)."""
        if not extra:
            self.keys, self.values, self.buffers = keys, values, None
            self.is_initialized = True
            return
        batch, heads, width, dim = keys.shape
        buffers = (keys.new_empty((batch, heads, width + extra, dim)),
                   values.new_empty((batch, heads, width + extra, values.shape[-1])))
        buffers[0][..., :width, :] = keys
        buffers[1][..., :width, :] = values
        self.buffers, self.start, self.used, self.allocated = buffers, 0, width, batch
        self.keys, self.values = buffers[0][..., :width, :], buffers[1][..., :width, :]
        self.is_initialized = True

    def lift(self, index: torch.Tensor, moving: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What `settle` needs to keep rows `index`: with buffers, the rows that move
        (`moving`, read out; the others stay where they are), else the kept rows."""
        if self.buffers is None:
            return self.keys[index], self.values[index]
        return tuple(buffer.index_select(0, moving) for buffer in self.buffers)

    def settle(self, lifted: tuple[torch.Tensor, ...], to: torch.Tensor, rows: int) -> None:
        """Keep `rows` rows: `lifted` (from `lift`) written at rows `to` of the buffers in
        place, which allocates nothing; the buffers' rows past `rows` stay allocated,
        unused, until they are next replaced (`allocated`)."""
        if self.buffers is None:
            self.keys, self.values = lifted
            return
        for buffer, moved in zip(self.buffers, lifted, strict=True):
            buffer.index_copy_(0, to, moved)
        self.buffers = (self.buffers[0][:rows], self.buffers[1][:rows])
        self.keys = self.buffers[0][..., self.start:self.used, :]
        self.values = self.buffers[1][..., self.start:self.used, :]

    def drop_left(self, columns: int) -> None:
        """Forget the batch's first `columns` columns (padding no row uses any more)."""
        skipped = min(columns, self.offset)
        self.offset -= skipped
        columns -= skipped
        self.keys, self.values = self.keys[..., columns:, :], self.values[..., columns:, :]
        if self.buffers is not None:
            self.start += columns

    def state(self) -> tuple[Any, ...]:
        return (self.keys, self.values, self.buffers, self.start, self.used, self.allocated,
                self.offset)

    def set_state(self, state: tuple[Any, ...]) -> None:
        (self.keys, self.values, self.buffers, self.start, self.used, self.allocated,
         self.offset) = state


class StateLayer(LinearAttentionLayer or object):  # type: ignore[misc]
    """A linear-attention or Mamba layer's states for every row (rows first): conv and
    recurrent, one of each per state index. Each update replaces a state (transformers'
    layer writes into it), so a step's `snapshot` holds the states before it."""

    def update_recurrent_state(self, recurrent_states: torch.Tensor | list[torch.Tensor],
                               state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        last = (recurrent_states if isinstance(recurrent_states, torch.Tensor)
                else recurrent_states[-1])
        self.recurrent_states[state_idx] = last
        return last

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every state it holds, conv then recurrent per state index."""
        return tuple(t for i in range(self.number_of_states)
                     for t in (self.conv_states[i], self.recurrent_states[i])
                     if t is not None)

    def hold(self, tensors: Sequence[torch.Tensor]) -> None:
        """Hold `tensors` (as `tensors()` gives them, rows selected or joined)."""
        given = iter(tensors)
        for i in range(self.number_of_states):
            for states in (self.conv_states, self.recurrent_states):
                if states[i] is not None:
                    states[i] = next(given)

    def row(self, row: int) -> StateRow:
        """Row `row`'s states, copies (a decode step writes a conv state in place): conv
        and recurrent per state index, None where the layer has no such state."""
        return tuple(None if states[i] is None else states[i][row:row + 1].clone()
                     for i in range(self.number_of_states)
                     for states in (self.conv_states, self.recurrent_states))

    def start_from(self, rows: Sequence[StateRow]) -> None:
        """Make a fresh layer hold `rows`' states (each as `row` gives it), stacked, so
        that a prefill goes on from them as from a previous forward of its own."""
        for i in range(self.number_of_states):
            if rows[0][2 * i] is not None:
                conv = torch.cat([r[2 * i] for r in rows])
                self.conv_states[i], self.conv_kernel_size[i] = conv, conv.shape[-1]
                self.is_conv_states_initialized[i] = True
                self.device, self.dtype = conv.device, conv.dtype
            if rows[0][2 * i + 1] is not None:
                self.recurrent_states[i] = torch.cat([r[2 * i + 1] for r in rows])
                self.is_recurrent_states_initialized[i] = True
            self.has_previous_state[i] = True

    def checkpoint(self) -> tuple[torch.Tensor, ...]:
        """The states now, for `hold` to put back; the conv states, which a decode step
        writes in place (transformers' `causal_conv1d_update`), are given copies to
        write into."""
        saved = self.tensors()
        for i in range(self.number_of_states):
            if self.conv_states[i] is not None:
                self.conv_states[i] = self.conv_states[i].clone()
        return saved


def _as_state(layer: Any) -> StateLayer:
    """`layer` (a fresh `LinearAttentionLayer`, as the cache made it for its layer) as a
    `StateLayer` with the same settings."""
    state = StateLayer.__new__(StateLayer)
    state.__dict__.update(layer.__dict__)
    return state


def is_kv(layer: Any) -> bool:
    return isinstance(layer, BufferedLayer)


def is_state(layer: Any) -> bool:
    return LinearAttentionLayer is not None and isinstance(layer, StateLayer)


def row_tensors(layer: Any) -> tuple[torch.Tensor, ...]:
    """A cache layer's per-row tensors: keys and values, states, or none (a layer of an
    MoE or MLP block, which caches nothing)."""
    if is_kv(layer):
        return layer.keys, layer.values
    if is_state(layer):
        return layer.tensors()
    return ()


def hold_rows(layer: Any, tensors: Sequence[torch.Tensor]) -> None:
    if is_kv(layer):
        layer.hold(*tensors)
    elif is_state(layer):
        layer.hold(tensors)


KV, SLIDING, STATE, NONE = "kv", "sliding", "state", "none"
"""How the pool holds a cache layer: keys and values of every position (full attention),
of a window's last positions (a sliding window: `BufferedLayer.trim`), a state per row,
or nothing (an MLP or MoE block's layer)."""


def _how_held(layer: Any, layer_type: str | None) -> str | None:
    """How the pool holds `layer` (a fresh cache's, of `layer_type` in the config's
    `layer_types`), or None where it cannot: a chunked or other local attention, or an
    older transformers' stand-in for a hybrid's state (a `DynamicLayer` of a
    non-attention layer type)."""
    kind = type(layer)
    if kind is DynamicLayer:
        return KV if layer_type in (None, "full_attention") else None
    if kind is DynamicSlidingWindowLayer:
        return SLIDING if layer_type in (None, "sliding_attention") else None
    if LinearAttentionLayer is not None and kind is LinearAttentionLayer:
        return STATE
    if DummyLayer is not None and kind is DummyLayer:
        return NONE
    return None


def _layers(config: Any) -> list[tuple[Any, str | None]]:
    """A fresh cache's layers for `config`, each with how the pool holds it."""
    cache = DynamicCache(config=config)
    types = list(getattr(config, "layer_types", None) or [None] * len(cache.layers))
    return [(layer, _how_held(layer, kind)) for layer, kind in zip(cache.layers, types,
                                                                   strict=False)]


def _named(config: Any, how: str | None) -> list[str]:
    types = getattr(config, "layer_types", None)
    return [f"{i}: {types[i] if types and how is None else type(layer).__name__}"
            for i, (layer, held) in enumerate(_layers(config)) if held == how]


def attention_windows(config: Any) -> list[int | None]:
    """Each attention layer's sliding window, in order: None for full attention."""
    return [layer.sliding_window if how == SLIDING else None
            for layer, how in _layers(config) if how in (KV, SLIDING)]


def state_layers(config: Any) -> list[str]:
    """The layers of `config`'s model the pool holds as a state per row (linear attention,
    Mamba, short convolution), by index."""
    return _named(config, STATE)


def sliding_layers(config: Any) -> list[str]:
    """The sliding-window attention layers of `config`'s model, by index."""
    return _named(config, SLIDING)


def unsupported_layers(config: Any) -> list[str]:
    """The cache layers of `config`'s model the pool cannot hold, by index: chunked or
    other local attention, and (an older transformers') hybrid states kept in a cache of
    the model's own, which looks like full attention there."""
    return _named(config, None)


def new_cache(config: Any, layers: LayerKV,
              states: Sequence[Sequence[StateRow]] = ()) -> DynamicCache:
    """A cache for `config`'s layers, holding `layers`' keys and values and `states`'
    rows (per recurrent layer, each row's as `StateLayer.row` gives it) if any: a
    prefill's cached prefixes. A `BufferedLayer` for each attention layer (marked
    `is_sliding` for a sliding window, so transformers sizes that mask against one, with
    its `window`), a `StateLayer` for each recurrent one.

    Raises:
        ValueError: a layer the pool cannot hold (`unsupported_layers`).
    """
    held = []
    for layer, how in _layers(config):
        if how is None:
            raise ValueError(f"decode pool: cannot hold a {type(layer).__name__} layer")
        if how == STATE:
            held.append(_as_state(layer))
        elif how == NONE:
            held.append(layer)
        else:
            buffered = BufferedLayer()
            buffered.is_sliding = how == SLIDING
            if buffered.is_sliding:
                buffered.window = layer.sliding_window
            held.append(buffered)
    cache = DynamicCache(config=config)
    cache.layers = held
    kv = [layer for layer in cache.layers if is_kv(layer)]
    for layer, (keys, values) in zip(kv, layers, strict=False):
        layer.hold(keys, values)
    for layer, rows in zip([layer for layer in cache.layers if is_state(layer)], states,
                           strict=False):
        layer.start_from(rows)
    return cache
