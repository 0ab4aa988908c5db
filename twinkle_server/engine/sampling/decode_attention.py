"""Attention for the decode pool's steps: one new query a row, against that row's cache.

A decode step's attention reads every row's whole cache for one query each, so it is
bound by memory, not arithmetic. transformers' sdpa path, on a CPU, runs its flash kernel
for these shapes and builds a `[rows, 1, 1, width]` mask through its general mask
machinery every layer's step. Here, under the name `DECODE_ATTENTION` (`decoding`):

- the mask is the pool's own `[rows, width]` padding mask, viewed, not rebuilt: a decode
  step's one query may see every cached position of its row, and padding is all it hides;
- attention groups the query heads that share a key/value head (GQA) as rows of one
  matrix product against that head's cache, so no key or value is copied or repeated.

Anything else (a prefill of several tokens, a mask of another shape) goes to sdpa as
before. The numbers are sdpa's to float32 rounding: the same softmax(QK^T / sqrt(d))V.
Measured on 2 CPU cores, 96 rows x 8 query heads over 4 KV heads x 200 positions: 1.0 ms
a layer against sdpa's 1.3 ms (`bench.limit --profile` shows a step's share).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

DECODE_ATTENTION = "twinkle_decode"
"""The attention implementation a decode step runs under (registered below)."""


def decode_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """A decode step's mask: the 2D padding mask as `[rows, 1, 1, width]` booleans (one
    query a row, which may see all of its row). Any other call: sdpa's own mask, with the
    arguments as given (their names changed across transformers 5.x)."""
    mask = kwargs.get("attention_mask")
    positions = kwargs.get("cache_position")
    q_length = kwargs.get("q_length", None if positions is None else positions.numel())
    if (not args and q_length == 1 and not kwargs.get("kv_offset")
            and mask is not None and mask.dim() == 2
            and mask.shape[-1] == kwargs.get("kv_length")):
        return mask[:, None, None, :].bool()
    return sdpa_mask(*args, **kwargs)


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """`query: [rows, heads, 1, d]`, `key`/`value: [rows, kv_heads, width, d]`, a boolean
    mask `[rows, 1, 1, width]` (True: attend) or None; returns `[rows, 1, heads, d]` and
    no weights, as transformers' attention functions do."""
    rows, heads, q_length, dim = query.shape
    kv_heads = key.shape[1]
    if q_length != 1 or dropout or heads % kv_heads or (
            attention_mask is not None and attention_mask.dtype != torch.bool):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    scale = dim ** -0.5 if scaling is None else scaling
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scale)
    if attention_mask is not None:
        scores.masked_fill_(~attention_mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    out = torch.matmul(weights, value)   # [rows, kv_heads, group, d]
    return out.reshape(rows, 1, heads, dim), None


AttentionInterface.register(DECODE_ATTENTION, decode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, decode_mask)


@contextlib.contextmanager
def decoding(model: torch.nn.Module) -> Iterator[None]:
    """Within this block an sdpa or eager `model` runs `decode_attention`. Switches
    `model.config._attn_implementation` (read by every attention layer on each forward)
    and puts it back after; other implementations are left as they are."""
    config = model.config
    previous = config._attn_implementation
    if previous not in ("sdpa", "eager"):
        yield
        return
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
