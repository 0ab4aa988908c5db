"""Packed passes: a merged pass's datums in one sequence, each attending only to itself.

Padded, a merged pass is `[datums, longest]`: a 64-token datum beside a 2048-token one
costs 2048 positions in every linear layer. Packed, the datums sit one after another in
ONE row `[1, total_tokens]`, and these keep each datum as it would be alone:

- position ids restart at 0 at every datum, so rotary embeddings see what they see alone;
- attention runs per datum (`packed_attention`): sdpa with `is_causal` on each datum's
  `[start, end)` of the queries and keys (consecutive datums of one length batched into
  one call), so no datum sees another and attention costs `sum(n_i^2)`, not `total^2`;
- the multi-LoRA router routes token segments of that row (`Router.route_tokens`);
- layers that carry state along the sequence (Gated DeltaNet linear attention, Mamba2)
  run their datums as padded rows, each state from zero (`engine.recurrent`).

What transformers (5.x, `masking_utils`) does with restarting position ids on its own:
with no 2D attention mask and no cache, `find_packed_sequence_indices` starts a new datum
wherever a position id is not the previous one plus 1, and `create_causal_mask` ANDs the
causal mask with "same datum". For sdpa and eager that is a dense `[1, 1, T, T]` mask
applied to every query-key pair: correct (tests/engine/test_packing.py checks it), but
`T^2` attention work and memory for a pass of T tokens, where the padded pass costs
`rows * longest^2`. And a 2D attention mask switches that detection off: position ids
then leave attention causal across the whole row, every datum seeing the ones before it.
So for sdpa and eager models a packed pass switches the model to `packed_attention` for
its duration (`attention`). Other implementations get the same inputs and pack on their
own: flash-attention kernels read `cu_seq_lens_*` (varlen), flex attention the position
ids.

What a model's attention layers hand their attention function beyond q, k and v (a
scale, a window, Gemma 2's logit soft cap, gpt-oss's sinks) is computed here and by the
decode pool's `decode_attention`, never dropped: anything else with a value is refused
when the engine loads the model (`check_attention`), and raises if it arrives anyway.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from twinkle_server.engine.base_model import BaseModel
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.lora import Router

PACKED_ATTENTION = "twinkle_packed_sdpa"
"""The attention implementation name a packed pass runs under (registered below)."""
_REPLACED = ("sdpa", "eager")
"""Implementations a packed pass replaces with `packed_attention`: both would apply a
dense `[T, T]` mask. Eager computes the same softmax(QK^T)V as sdpa, to rounding."""
SERVED_ARGUMENTS = frozenset({"dropout", "scaling", "sliding_window", "softcap", "s_aux",
                              "is_causal"})
"""The attention arguments `packed_attention` and the decode pool's `decode_attention`
compute (`is_causal` only as True: these are causal functions)."""
_CARRIED = frozenset({"position_ids", "cache_position", "use_cache", "past_key_values",
                      "output_attentions", "output_hidden_states", "output_router_logits",
                      "return_dict", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                      "max_length_k"})
"""Arguments a model's forward hands on to its attention function that say nothing about
the attention (a packed row's boundaries are read from `cu_seq_lens_q`)."""
_PROBE = "twinkle_attention_probe"
_probed: list[dict[str, Any]] = []


def unserved(arguments: dict[str, Any]) -> list[str]:
    """The names among an attention call's keyword `arguments` that carry a value the
    engine's attention functions would not compute (None is no value: a layer without a
    window passes `sliding_window=None`)."""
    names = sorted(name for name, value in arguments.items() if value is not None
                   and name not in SERVED_ARGUMENTS and name not in _CARRIED)
    if arguments.get("is_causal") is False:
        names.append("is_causal=False")
    return names


def _record(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
            value: torch.Tensor, attention_mask: torch.Tensor | None, **kwargs: Any
            ) -> tuple[torch.Tensor, None]:
    """`check_attention`'s stand-in: notes the call's arguments, returns zeros."""
    _probed.append(kwargs)
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


def check_attention(model: torch.nn.Module, arch: str) -> None:
    """Refuse an sdpa or eager model whose attention layers pass an argument that
    `packed_attention` and `decode_attention` (which replace its attention in packed
    passes and decode steps) do not compute: they would drop it and give other numbers
    than the model's own attention, silently. One 8-token probe forward, at load; other
    implementations (flash, flex) keep their own attention and are not probed. Raises
    InvalidArgument naming the arguments."""
    config = model.config
    previous = config._attn_implementation
    if previous not in _REPLACED:
        return
    vocab = int(model.get_input_embeddings().weight.shape[0])
    device = next(model.parameters()).device
    ids = (torch.arange(8, device=device) * 7919 % vocab)[None]
    _probed.clear()
    config._attn_implementation = _PROBE
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        config._attn_implementation = previous
    names = sorted({name for arguments in _probed for name in unserved(arguments)})
    _probed.clear()
    if names:
        raise InvalidArgument(
            f"model: {arch}'s attention layers pass {names} to their attention function, "
            f"which the engine's packed and decode attention do not compute (they compute "
            f"{sorted(SERVED_ARGUMENTS)}); serving it would drop them and change its numbers")


@dataclass(frozen=True)
class PassLayout:
    """Where a merged pass's datums ("rows") sit in the base model's inputs and outputs.

    `lengths[i]` is row i's token count, in pass order. Packed: the rows one after another
    in one sequence, the model's outputs `[1, total, ...]`. Padded: row i right-padded
    to `width` in `[rows, width, ...]`. `row_tokens(out)` reads either as `[total, ...]`,
    row i at `offsets[i]:offsets[i] + lengths[i]`: the one view of a pass's outputs (logits
    or last hidden states) that the loss code reads, whatever the layout.
    """

    lengths: tuple[int, ...]
    packed: bool

    @property
    def total(self) -> int:
        """Real tokens in the pass: what the device computes when packed."""
        return sum(self.lengths)

    @property
    def width(self) -> int:
        """The padded row width (the longest row); the packed row's is `total`."""
        return self.total if self.packed else max(self.lengths)

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Row i's first token in `row_tokens`' output (and in the packed row)."""
        return tuple(np.concatenate([[0], np.cumsum(self.lengths[:-1])]).tolist())

    def model_inputs(self, base: BaseModel, input_ids: Sequence[np.ndarray]
                     ) -> dict[str, Any]:
        """Keyword arguments for `base.model`'s forward over these rows (`input_ids[i]`
        of length `lengths[i]`).

        Packed: `input_ids` and `position_ids` `[1, total]` (positions restart per row),
        the rows' boundaries as `cu_seq_lens_q/k` `[rows + 1]` int32 and
        `max_length_q/k`; the boundaries stay on the CPU when `packed_attention` reads them
        (as Python ints: no device sync per layer) and go to the device for a
        flash-attention model's varlen kernels. Padded: `input_ids [rows, width]` and the
        2D `attention_mask`, None when no row is padded (the plain causal path is the
        fastest kernel).
        """
        device = base.device
        if self.packed:
            ids = torch.from_numpy(np.concatenate([np.asarray(i, np.int64) for i in input_ids]))
            lengths = torch.tensor(self.lengths)
            starts = torch.tensor(self.offsets).repeat_interleave(lengths)
            positions = torch.arange(self.total) - starts
            bounds = torch.tensor((*self.offsets, self.total), dtype=torch.int32)
            if base.model.config._attn_implementation not in _REPLACED:
                bounds = bounds.to(device)
            return {"input_ids": ids[None].to(device), "position_ids": positions[None].to(device),
                    "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
                    "max_length_q": max(self.lengths), "max_length_k": max(self.lengths)}
        width = self.width
        ids = torch.full((len(self.lengths), width), base.pad_token_id, dtype=torch.long)
        for row, (n, row_ids) in enumerate(zip(self.lengths, input_ids, strict=True)):
            ids[row, :n] = torch.from_numpy(np.asarray(row_ids, np.int64))
        mask = None
        if min(self.lengths) != width:
            mask = (torch.arange(width)[None] < torch.tensor(self.lengths)[:, None]).long()
            mask = mask.to(device)
        return {"input_ids": ids.to(device), "attention_mask": mask}

    def route(self, router: Router, adapter_ids: Sequence[str | None],
              train: Sequence[bool]) -> contextlib.AbstractContextManager[None]:
        """Route row i to `adapter_ids[i]`: token segments of the packed row, or rows."""
        if self.packed:
            return router.route_tokens(self.lengths, adapter_ids, train)
        return router.route(adapter_ids, train)

    def row_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """`[total, ...]`: every row's real positions of a pass output, row after row.

        Packed and same-length padded passes are views (no copy); a padded pass of mixed
        lengths gathers its real positions once.
        """
        if self.packed:
            if out.shape[0] != 1 or out.shape[1] != self.total:
                raise ValueError(f"row_tokens: a packed pass's output is [1, {self.total}, "
                                 f"...], got {list(out.shape)}")
            return out[0]
        flat = out.flatten(0, 1)
        if min(self.lengths) == self.width:
            return flat
        return flat[self._padded_index.to(out.device)]

    @cached_property
    def _padded_index(self) -> torch.Tensor:
        return torch.cat([row * self.width + torch.arange(n)
                          for row, n in enumerate(self.lengths)])


@contextlib.contextmanager
def attention(model: torch.nn.Module, layout: PassLayout) -> Iterator[None]:
    """Within this block, a packed pass of an sdpa or eager `model` runs `packed_attention`.

    Switches `model.config._attn_implementation`, which every attention layer reads on
    each forward, and puts it back after. Padded passes and other implementations are
    left as they are. The engine runs one pass at a time, on one thread.
    """
    config = model.config
    previous = config._attn_implementation
    if not layout.packed or previous not in _REPLACED:
        yield
        return
    config._attn_implementation = PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


def datum_lengths(cu_seq_lens: torch.Tensor, tokens: int) -> list[int]:
    """Each datum's token count from a packed row's boundaries `[0, ..., tokens]`."""
    bounds = cu_seq_lens.tolist()
    if bounds[0] != 0 or bounds[-1] != tokens:
        raise ValueError(f"packed attention: cu_seq_lens {bounds} do not span the row's "
                         f"{tokens} tokens")
    return [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None,
                     s_aux: torch.Tensor | None = None, softcap: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over one packed row: each datum's queries attend causally to its own
    keys and to nothing else.

    `query: [1, heads, T, d]`, `key`/`value: [1, kv_heads, T, d]` (transformers' attention
    interface), `cu_seq_lens_q` the datums' boundaries on the CPU. One sdpa call per run
    of consecutive datums of one length, batched over the run (`[datums, heads, n, d]`
    views, as a padded pass of equal rows would run): a batch of equal lengths costs what
    it costs padded, a mixed one `sum(n_i^2)`. A sliding-window layer gets a banded mask
    on datums longer than its window. Attention sinks (`s_aux`, gpt-oss: one learned
    logit per head in every softmax's denominator) and a logit soft cap (`softcap`, Gemma
    2: scores become `tanh(scores / softcap) * softcap` before the mask and softmax) run
    `_scores_attention`, as the model's own eager attention computes them; sdpa can do
    neither. Returns `[1, T, heads, d]` and no weights, as transformers' own attention
    functions do. Raises ValueError without boundaries, with an `attention_mask` (a
    packed pass has none) or with an argument it does not compute (`unserved`).
    """
    if cu_seq_lens_q is None or query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("packed attention: needs one packed row, its cu_seq_lens_q and no "
                         "attention mask (PassLayout.model_inputs builds them)")
    if names := unserved(kwargs):
        raise ValueError(f"packed attention: does not compute {names} (check_attention "
                         "refuses such a model at load)")
    lengths = datum_lengths(cu_seq_lens_q, query.shape[2])
    runs = [(n, len(list(group))) for n, group in itertools.groupby(lengths)]
    if len(runs) == 1:
        pieces: Any = [(query, key, value)]
    else:
        sizes = [n * count for n, count in runs]
        pieces = zip(query.split(sizes, 2), key.split(sizes, 2), value.split(sizes, 2),
                     strict=True)
    outputs = []
    for (n, count), tensors in zip(runs, pieces, strict=True):
        # [1, heads, count * n, d] -> [count, heads, n, d]: a view, no copy.
        q, k, v = (t.unflatten(2, (count, n))[0].transpose(0, 1) for t in tensors)
        band = None
        if sliding_window is not None and n > sliding_window:
            # transformers' sliding window: query i sees keys (i - window, i].
            i = torch.arange(n, device=q.device)
            band = ((i[:, None] >= i[None]) & (i[:, None] - i[None] < sliding_window))[None, None]
        if s_aux is not None or softcap is not None:
            out = _scores_attention(module, q, k, v, band, dropout, scaling, s_aux, softcap)
        else:
            out = sdpa_attention_forward(module, q, k, v, band, dropout=dropout,
                                         scaling=scaling)[0]
        outputs.append(out.reshape(1, count * n, *out.shape[2:]))
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)), None


def _scores_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, band: torch.Tensor | None, dropout: float,
                      scaling: float | None, sinks: torch.Tensor | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Causal attention of `[b, heads, n, d]` rows (only keys `band` keeps, when given)
    from explicit scores, as a model's eager attention computes them where sdpa cannot:
    a soft cap `tanh(scores / softcap) * softcap` before the mask (Gemma 2,
    `modeling_gemma2.eager_attention_forward`), and one sink logit per head joining each
    softmax and dropped after it (gpt-oss, `modeling_gpt_oss.eager_attention_forward`).
    The softmax runs in float32 as Gemma 2's does, or in the scores' dtype beside sinks
    as gpt-oss's does. Returns `[b, n, heads, d]`; costs `[b, heads, n, n]` scores."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    n = query.shape[2]
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    logits = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    keep = band if band is not None else torch.ones(
        n, n, dtype=torch.bool, device=query.device).tril()[None, None]
    logits = logits.masked_fill(~keep, float("-inf"))
    if sinks is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, n, 1).to(logits.dtype)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs.to(value.dtype), value).transpose(1, 2)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionInterface.register(_PROBE, _record)
# No mask function is registered under PACKED_ATTENTION (nor _PROBE) on purpose:
# transformers' `_preprocess_mask_arguments` then returns no mask at all (an implementation
# "without equivalent mask creation"), so a packed pass builds no [T, T] mask it would not use.
