"""Batch-invariant sampling forwards: a row's numbers do not depend on the batch it is in.

A seeded request should give the same tokens, bit for bit, alone or beside any other
tenants' requests, whatever decode slice it lands in, whether its prompt's prefix came
from the prefix cache or was computed with it, in the decode pool or the static batch.
Plain forwards break that in three places, each of which rounds a row's sums in an order
that depends on the batch's shape:

- matrix products: BLAS picks its kernel by the row count (on an AMD EPYC, MKL's SGEMM
  gives a row other bits at 1, at 2-3 and at 4+ rows), and a one-token decode step and a
  prompt's prefill run the same rows at different counts;
- attention: sdpa's CPU kernel splits the keys into blocks whose size follows the query
  count, and the decode path's one product over a left-padded batch sums a row's keys at
  columns that shift with the widest row;
- element-wise transcendentals (`exp`, `silu`, ...): torch runs whole 16- or 32-lane
  vectors and finishes a run's last few elements with the scalar function, which may
  round differently; where a run ends depends on the tensor's size and, above 32,768
  elements, on how its range is split over threads.

Within `computing(model)` (the mode `--batch-invariant on` runs every sampling forward
in) each is fixed by construction:

- every `F.linear` (and the LoRA delta's `addmm_`) runs as products of `ROW_TILE` rows,
  the last tile padded with zeros, batched as tiles: one shape for every row, whatever
  the batch (a row's result in a product of one shape is the same at any position among
  the tile's rows and in any number of tiles: SGEMM computes each output from its row and
  column alone, in an order set by the shape; `tests/engine/test_batch_invariant.py`
  checks this on the machine it runs on);
- attention (`invariant_attention`) reads each row's keys in position order, in pages of
  `PAGE` positions counted from position 0: scores are sums over the head dimension
  (one fixed-length reduction per score), each page's softmax share and weighted values
  are sums over one page's fixed width, and pages are combined one after another with
  the online-softmax update, where a page a row does not reach changes nothing exactly
  (its weights are exactly 0 and its rescale exactly 1). Padding, holes left by cached
  prefixes of other lengths, and the batch's width therefore change no row's sums;
- element-wise transcendentals run in serial pieces of whole 64-element vectors over a
  copy padded to a multiple of 64, so every element is computed by the vector kernel.

Row-wise reductions (RMSNorm's mean over the hidden size, the token step's softmax over
the vocabulary) are already invariant: torch reduces each row by itself, in an order set
by the row's length, and splits only the rows among threads.

What this holds for: a given machine, torch build and thread count (CPU kernels differ by
instruction set; another machine gives other bits, the same on every run there). On CUDA
the same construction needs a fixed tile per product as here (cuBLAS picks split-K by
shape), attention with a fixed page size and an ordered combine, and no atomics in
reductions; the CUDA path is not measured here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from twinkle_server.engine.packing import unserved

ROW_TILE = 16
"""Rows of every matrix product in the mode: the batch's rows in tiles of this many."""
PAGE = 32
"""Key positions one step of attention's ordered combine reads per row."""
_VECTOR = 64
"""Elements a serial element-wise piece is a multiple of: whole vectors of any x86 width."""
_PIECE = 32_768 - _VECTOR
"""Elements of one serial piece: under torch's 32,768-element grain, so no thread split."""

INVARIANT_ATTENTION = "twinkle_invariant"
"""The attention implementation sampling forwards run under in the mode (registered below)."""


def _rows_times(rows: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """`rows @ matrix` (`[count, k] @ [k, n]`) as products of `ROW_TILE` rows each, the
    last tile padded with zeros: one batched product of the tiles, each against the same
    `matrix` (expanded, not copied)."""
    count, inner = rows.shape
    tiles = max(-(-count // ROW_TILE), 1)
    padded = rows.new_zeros((tiles * ROW_TILE, inner))
    padded[:count] = rows
    out = torch.bmm(padded.view(tiles, ROW_TILE, inner),
                    matrix.expand(tiles, *matrix.shape))
    return out.view(tiles * ROW_TILE, matrix.shape[1])[:count]


def _linear(x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` by `_rows_times`."""
    out = _rows_times(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _addmm_(into: torch.Tensor, rows: torch.Tensor, matrix: torch.Tensor, *,
            beta: float = 1, alpha: float = 1) -> torch.Tensor:
    """`Tensor.addmm_` (the LoRA delta's in-place add) by `_rows_times`."""
    product = _rows_times(rows, matrix)
    if beta != 1:
        into.mul_(beta)
    return into.add_(product, alpha=alpha)


def _vectorwise(function: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any,
                **kwargs: Any) -> torch.Tensor:
    """`function(x)` element by element, every element by torch's vector kernel: over a
    contiguous copy padded to whole vectors, in serial pieces (none split among threads)."""
    flat = x.contiguous().reshape(-1)
    count = flat.numel()
    padded = flat.new_zeros(-(-count // _VECTOR) * _VECTOR)
    padded[:count] = flat
    out = torch.empty_like(padded)
    for start in range(0, padded.numel(), _PIECE):
        piece = slice(start, start + _PIECE)
        out[piece] = function(padded[piece], *args, **kwargs)
    return out[:count].reshape(x.shape)


_TRANSCENDENTAL = {
    F.silu, F.gelu, torch.exp, torch.Tensor.exp, torch.sigmoid, torch.Tensor.sigmoid,
    torch.tanh, torch.Tensor.tanh, torch.cos, torch.Tensor.cos, torch.sin, torch.Tensor.sin,
    torch.log, torch.Tensor.log, F.softplus,
}
"""Element-wise functions whose scalar and vector kernels may round differently."""


class _Invariant(TorchFunctionMode):
    """Routes `F.linear`, `Tensor.addmm_` and the element-wise transcendentals through
    their invariant forms (float tensors without autograd: what sampling runs)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            return _linear(*args, **kwargs)
        if func is torch.Tensor.addmm_:
            return _addmm_(*args, **kwargs)
        if func in _TRANSCENDENTAL and isinstance(args[0], torch.Tensor) \
                and args[0].is_floating_point() and not kwargs.get("inplace"):
            return _vectorwise(func, *args, **kwargs)
        return func(*args, **kwargs)


def invariant_mask(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The mask `invariant_attention` reads: the batch's 2-D padding mask (True: a real
    position) as `[rows, 1, 1, width]`; the causal rule comes from positions."""
    mask = kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2:
        raise ValueError("batch-invariant attention needs the batch's 2-D padding mask")
    return mask[:, None, None, :].bool()


def invariant_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None,
                        softcap: float | None = None, **kwargs: Any
                        ) -> tuple[torch.Tensor, None]:
    """softmax(QK^T / sqrt(d))V for `query: [rows, heads, q, d]` (the last q of the keys'
    columns), `key`/`value: [rows, kv_heads, width, d]` and the padding mask from
    `invariant_mask`, every row's sums in an order set by its own positions (the module
    docstring); a soft cap (`softcap`, Gemma 2) applied to each score before the mask, as
    the model's eager attention does. Returns `[rows, q, heads, d]` and no weights."""
    if (dropout or kwargs.get("sliding_window") or kwargs.get("s_aux") is not None
            or attention_mask is None or unserved(kwargs)):
        raise ValueError("batch-invariant attention is full causal attention without "
                         "dropout, sinks or other arguments "
                         f"({unserved(kwargs)}), over the batch's padding mask")
    rows, heads, q_length, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    real = attention_mask.reshape(rows, width)
    # Each real column's position in its row; each query's is its own column's.
    position = real.long().cumsum(-1) - 1
    query_position = torch.where(real[:, -q_length:], position[:, -q_length:], -1)
    count = real.sum(-1)
    # The real columns of each row in position order, then the rest.
    order = torch.sort((~real).to(torch.int8), dim=-1, stable=True).indices
    pages = -(-int(count.max()) // PAGE)
    order = F.pad(order, (0, pages * PAGE - width)) if pages * PAGE > width else order
    grouped = query.reshape(rows, kv_heads, group, q_length, dim).transpose(2, 3)
    best = query.new_full((rows, kv_heads, q_length, group), float("-inf"))
    total = query.new_zeros((rows, kv_heads, q_length, group))
    out = query.new_zeros((rows, kv_heads, q_length, group, dim))
    for page in range(pages):
        span = torch.arange(page * PAGE, (page + 1) * PAGE, device=query.device)
        columns = order[:, page * PAGE:(page + 1) * PAGE]
        index = columns[:, None, :, None].expand(rows, kv_heads, PAGE, dim)
        keys = torch.gather(key, 2, index)
        values = torch.gather(value, 2, index)
        present = span[None, :] < count[:, None]                       # [rows, PAGE]
        values = values.masked_fill(~present[:, None, :, None], 0.0)
        seen = present[:, None, :] & (span[None, None, :] <= query_position[:, :, None])
        scores = (grouped[..., None, :] * keys[:, :, None, None]).sum(-1) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~seen[:, None, :, None, :], float("-inf"))
        new_best = torch.maximum(best, scores.amax(-1))
        anchor = torch.where(new_best == float("-inf"), 0.0, new_best)
        weights = torch.exp(scores - anchor[..., None])
        rescale = torch.exp(best - anchor)
        total = total * rescale + weights.sum(-1)
        shares = (weights[..., None, :] * values.transpose(-1, -2)[:, :, None, None]).sum(-1)
        out = out * rescale[..., None] + shares
        best = new_best
    out = torch.where(total[..., None] > 0, out / total[..., None], 0.0)
    return out.permute(0, 2, 1, 3, 4).reshape(rows, q_length, heads, dim), None


AttentionInterface.register(INVARIANT_ATTENTION, invariant_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(INVARIANT_ATTENTION, invariant_mask)


@contextlib.contextmanager
def computing(model: torch.nn.Module) -> Iterator[None]:
    """Within this block `model`'s forwards are batch-invariant: its attention layers run
    `invariant_attention` and every linear and element-wise transcendental its invariant
    form. Puts `model.config._attn_implementation` back after."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = INVARIANT_ATTENTION
    try:
        with _Invariant():
            yield
    finally:
        config._attn_implementation = previous
