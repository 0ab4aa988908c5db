"""Attention for the decode pool's steps: one new query a row, against that row's cache.

A decode step's attention reads every row's whole cache for one query each, so it is
bound by memory, not arithmetic. transformers' sdpa path, on a CPU, runs its flash kernel
for these shapes and builds a `[rows, 1, 1, width]` mask through its general mask
machinery every layer's step. Here, under the name `DECODE_ATTENTION` (`decoding`):

- the mask is the pool's own `[rows, width]` padding mask, viewed, not rebuilt: a decode
  step's one query may see every cached position of its row, and padding is all it hides;
- attention groups the query heads that share a key/value head (GQA) as rows of one
  matrix product against that head's cache, so no key or value is copied or repeated;
- the columns a request's samples hold alike (its prompt: `KVBatch.shared_prefix`, given
  to `decoding` while every request has as many rows and the pool has room for the
  copy, which admission keeps for it) are read once per request: the
  queries of all its samples go as rows of one product against them, and each row's own
  columns follow in a second. A step's attention is bound by reading the cache, and an
  RL group's 4 samples of a 64-token prompt otherwise read it 4 times.

Anything else (a prefill of several tokens, a mask of another shape) goes to sdpa as
before. The numbers are sdpa's to float32 rounding: the same softmax(QK^T / sqrt(d))V,
with Gemma 2's logit soft cap and gpt-oss's sinks as their eager attention applies them.
Measured on 2 CPU cores, 96 rows x 8 query heads over 4 KV heads x 200 positions: 1.0 ms
a layer against sdpa's 1.3 ms (`bench.limit --profile` shows a step's share).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from twinkle_server.engine.packing import unserved
from twinkle_server.engine.sampling.kv_batch import SharedPrefix

DECODE_ATTENTION = "twinkle_decode"
"""The attention implementation a decode step runs under (registered below)."""

_SHARED: ContextVar[SharedPrefix | None] = ContextVar("twinkle_shared_prefix", default=None)


def decode_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """A decode step's mask: the 2D padding mask as `[rows, 1, 1, width]` booleans (one
    query a row, which may see all of its row), or None when it hides nothing (no row is
    padded). For a sliding-window layer (`local_size` W) each row sees its last W real
    positions, the new one among them, as transformers' window `q - W < k <= q` does;
    the row's real columns are its positions in order, padding left out. A layer that
    holds only the batch's columns from `kv_offset` on gets those of the mask. Any other
    call: sdpa's own mask, with the arguments as given (their names changed across
    transformers 5.x)."""
    mask = kwargs.get("attention_mask")
    positions = kwargs.get("cache_position")
    q_length = kwargs.get("q_length", None if positions is None else positions.numel())
    offset, length = kwargs.get("kv_offset") or 0, kwargs.get("kv_length")
    if (not args and q_length == 1 and mask is not None and mask.dim() == 2
            and length is not None and mask.shape[-1] == offset + length):
        mask = mask[:, offset:]
        window = kwargs.get("local_size")
        if window is not None:
            keep = mask.bool() & (mask.flip(-1).cumsum(-1).flip(-1) <= window)
            return keep[:, None, None, :]
        return None if bool(mask.all()) else mask[:, None, None, :].bool()
    return sdpa_mask(*args, **kwargs)


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`query: [rows, heads, 1, d]`, `key`/`value: [rows, kv_heads, width, d]`, a boolean
    mask `[rows, 1, 1, width]` (True: attend) or None; returns `[rows, 1, heads, d]` and
    no weights, as transformers' attention functions do. A soft cap (`softcap`, Gemma 2)
    turns the scores into `tanh(scores / softcap) * softcap` before the mask, as the
    model's eager attention does; attention sinks come from `module.sinks` (gpt-oss).
    Raises ValueError on an argument it does not compute (`packing.unserved`; the engine
    refuses such a model at load), and where sdpa would have to drop a cap or sinks."""
    if names := unserved(kwargs):
        raise ValueError(f"decode attention: does not compute {names}")
    rows, heads, q_length, dim = query.shape
    kv_heads = key.shape[1]
    if q_length != 1 or dropout or heads % kv_heads or (
            attention_mask is not None and attention_mask.dtype != torch.bool):
        if softcap is not None or getattr(module, "sinks", None) is not None:
            raise ValueError("decode attention: sdpa computes no soft cap or sinks; a decode "
                             "step's attention is one query a row without dropout")
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    scale = dim ** -0.5 if scaling is None else scaling
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    shared = _SHARED.get()
    layer = getattr(module, "layer_idx", None)
    if layer is None or (shared is not None and (shared.keys[layer] is None
                                                  or key.shape[-2] < shared.width)):
        shared = None
    if shared is None:
        scores = torch.matmul(grouped, key.transpose(-1, -2))
    else:
        width = shared.width
        scores = torch.cat([
            _to_rows(torch.matmul(_to_groups(grouped, shared),
                                  shared.keys[layer].transpose(-1, -2)), shared),
            torch.matmul(grouped, key[:, :, width:].transpose(-1, -2))], dim=-1)
    scores.mul_(scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores.masked_fill_(~attention_mask, float("-inf"))
    sinks = getattr(module, "sinks", None)
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    else:   # gpt-oss: a learned logit per head joins each softmax, then is dropped
        sink = sinks.reshape(1, kv_heads, heads // kv_heads, 1).expand(rows, -1, -1, 1)
        both = torch.cat([scores, sink.to(scores.dtype)], dim=-1)
        both = both - both.max(dim=-1, keepdim=True).values
        weights = torch.softmax(both, dim=-1, dtype=both.dtype)[..., :-1].to(value.dtype)
    if shared is None:
        out = torch.matmul(weights, value)   # [rows, kv_heads, group, d]
    else:
        width = shared.width
        out = _to_rows(torch.matmul(_to_groups(weights[..., :width], shared),
                                    shared.values[layer]), shared)
        out += torch.matmul(weights[..., width:], value[:, :, width:])
    return out.reshape(rows, 1, heads, dim), None


def _to_groups(x: torch.Tensor, shared: SharedPrefix) -> torch.Tensor:
    """`[rows, kv_heads, group, c]` as `[groups, kv_heads, samples * group, c]`: each
    request's samples stacked."""
    _, kv_heads, group, c = x.shape
    return (x.reshape(shared.groups, shared.samples, kv_heads, group, c).transpose(1, 2)
            .reshape(shared.groups, kv_heads, shared.samples * group, c))


def _to_rows(y: torch.Tensor, shared: SharedPrefix) -> torch.Tensor:
    """The inverse of `_to_groups`: `[groups, kv_heads, samples * group, c]` back to each
    row's `[rows, kv_heads, group, c]`."""
    groups, kv_heads, stacked, c = y.shape
    group = stacked // shared.samples
    return (y.reshape(groups, kv_heads, shared.samples, group, c).transpose(1, 2)
            .reshape(groups * shared.samples, kv_heads, group, c))


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, decode_mask)


@contextlib.contextmanager
def decoding(model: torch.nn.Module, shared: SharedPrefix | None = None) -> Iterator[None]:
    """Within this block an sdpa or eager `model` runs `decode_attention`, with `shared`
    the batch's shared prefix (None: each row reads all of its own cache). Switches
    `model.config._attn_implementation` (read by every attention layer on each forward)
    and puts it back after; other implementations are left as they are."""
    config = model.config
    previous = config._attn_implementation
    if previous not in ("sdpa", "eager"):
        yield
        return
    config._attn_implementation = DECODE_ATTENTION
    token = _SHARED.set(shared)
    try:
        yield
    finally:
        _SHARED.reset(token)
        config._attn_implementation = previous
