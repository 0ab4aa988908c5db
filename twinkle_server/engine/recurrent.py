"""Layers that carry state along a sequence (linear attention, Mamba) in packed passes.

A packed pass (`engine.packing`) puts its datums one after another in one sequence and
confines attention to each. Gated DeltaNet linear attention (Qwen3.5, Qwen3.6, Qwen3-Next)
and Mamba2 (Nemotron-H) carry two things along the sequence instead of a KV cache: a
causal depthwise conv1d over the last few positions, and a recurrent state over all of
them. Through one packed sequence both would flow from one datum into the next. On CPU
transformers' torch paths either refuse the packed boundaries (Gated DeltaNet: a
ValueError that asks for `flash-linear-attention`) or ignore them (Mamba2: silently wrong
numbers); the kernels that honour them run on CUDA only.

So each such mixer, given a packed pass (its `cu_seq_lens_q` boundaries), runs its datums
as right-padded rows `[datums, longest, hidden]` with their padding mask, every row's
conv and state starting from zero at its first token, exactly as the datum alone would;
the multi-LoRA router routes those rows (`Router.route`) for the mixer's projections.
Right padding cannot reach a real token: a row's real tokens come first and both the
conv and the state are causal (the mask also zeroes the padding, as in a padded pass).
Datums are padded in consecutive groups whose padding stays within their real tokens, so
the mixers compute at most twice the pass's tokens (one group when lengths are equal). Everything outside the
mixers (projections elsewhere, MLPs, attention) stays packed.

Mixers of another kind that carry state (a class this module does not know that holds a
causal depthwise conv1d, or is named like Mamba or DeltaNet) cannot be packed exactly:
`unpackable` names them, and the engine then pads every merged pass instead, as
`--packing off` does (logged once at start).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from packaging.version import Version
from torch import nn

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.lora import Router, Segment
from twinkle_server.engine.packing import datum_lengths

MIXERS: dict[str, str] = {
    "Qwen3_5GatedDeltaNet": "Gated DeltaNet linear attention",
    "Qwen3_5MoeGatedDeltaNet": "Gated DeltaNet linear attention",
    "Qwen3NextGatedDeltaNet": "Gated DeltaNet linear attention",
    "NemotronHMamba2Mixer": "Mamba2",
}
"""Mixer classes whose forward is `(hidden_states, cache, attention_mask, **kwargs)` and
that honour a right-padding mask: packed passes run them per datum (`PerDatum`)."""

_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""A packed pass's boundary arguments (`PassLayout.model_inputs`), not the mixers'."""
_STATEFUL_NAMES = ("Mamba", "DeltaNet", "Rwkv", "LinearAttention", "Recurrent")
"""Class-name marks of sequence-state layers, for kinds this module does not know."""


class PerDatum:
    """A mixer's forward that, in a packed pass, runs each datum as its own row.

    Set as the mixer's instance `forward` by `install`; outside packed passes (sampling,
    padded passes: no `cu_seq_lens_q`) it calls the mixer's own forward unchanged.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], router: Router) -> None:
        self.forward = forward
        self.router = router

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        bounds = kwargs.get("cu_seq_lens_q")
        if bounds is None:
            return self.forward(*args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in _PACKED_KWARGS}
        if "hidden_states" in kwargs:
            hidden = kwargs.pop("hidden_states")
        else:
            hidden, *rest = args
            args = tuple(rest)
        if hidden.shape[0] != 1 or kwargs.get("attention_mask") is not None or args:
            raise ValueError("packed mixer: needs one packed row [1, tokens, hidden], its "
                             "cu_seq_lens_q and no attention mask (PassLayout.model_inputs)")
        lengths = datum_lengths(bounds, hidden.shape[1])
        outputs = []
        first, start = 0, 0
        for group in padding_groups(lengths):
            sizes = lengths[first:first + group]
            piece = hidden[:, start:start + sum(sizes)]
            outputs.append(self._rows(piece, sizes, start, kwargs))
            first, start = first + group, start + sum(sizes)
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _rows(self, piece: torch.Tensor, lengths: Sequence[int], offset: int,
              kwargs: dict[str, Any]) -> torch.Tensor:
        """The mixer over `piece` (`[1, sum(lengths), hidden]`, packed tokens from
        `offset` on) run as right-padded rows, its output packed again."""
        rows, width = len(lengths), max(lengths)
        padded = min(lengths) != width
        if padded:
            index = torch.cat([row * width + torch.arange(n) for row, n in enumerate(lengths)]
                              ).to(piece.device)
            batch = piece.new_zeros(rows * width, piece.shape[-1]).index_copy(0, index, piece[0])
            batch = batch.view(rows, width, -1)
            mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
            kwargs = {**kwargs, "attention_mask": mask.to(piece.device)}
        else:
            batch = piece.view(rows, width, -1)
        ids, train = self._row_routes(lengths, offset)
        with self.router.route(ids, train):
            out = self.forward(batch, **kwargs)
        if padded:
            return out.flatten(0, 1).index_select(0, index)[None]
        return out.reshape(1, rows * width, -1)

    def _row_routes(self, lengths: Sequence[int], offset: int
                    ) -> tuple[list[str | None], list[bool]]:
        """Each row's adapter and dropout flag: those of the router's token segment that
        holds the datum (segments are built from whole datums, `PassLayout.route`)."""
        segments = self.router.segments
        ids: list[str | None] = []
        train: list[bool] = []
        start = offset
        for n in lengths:
            segment = next((s for s in segments if s.start <= start < s.end),
                           Segment(None, start, start + n))
            if start + n > segment.end:
                raise ValueError(f"packed mixer: the datum at token {start} spans two router "
                                 "segments; a pass routes whole datums")
            ids.append(segment.adapter_id)
            train.append(segment.train)
            start += n
        return ids, train


def padding_groups(lengths: Sequence[int]) -> list[int]:
    """Sizes of consecutive groups of datums (of `lengths` tokens) each padded to its
    longest, a datum joining the group before while the group's padding stays within its
    real tokens (equal lengths: one group)."""
    groups: list[int] = []
    count, tokens, longest = 0, 0, 0
    for n in lengths:
        wider = max(longest, n)
        if count and (count + 1) * wider > 2 * (tokens + n):
            groups.append(count)
            count, tokens, wider = 0, 0, n
        count, tokens, longest = count + 1, tokens + n, wider
    return [*groups, count] if count else groups


VERIFIED_TRANSFORMERS = "5.25.0"
"""The oldest transformers whose `MIXERS` this engine was checked against transformers +
peft on (tests/engine/test_hybrid_layers.py). Under 5.0.0 their mixers took no pass
arguments and a merged pass disagreed with each adapter alone by 0.3 in logprobs."""


def refusal(model: nn.Module, installed: str) -> InvalidArgument | None:
    """Why the engine cannot train `model` under transformers `installed`: it has
    linear-attention or Mamba mixers and `installed` predates VERIFIED_TRANSFORMERS; or
    None. Refused at load, by name, rather than trained on numbers never checked."""
    kinds = sorted({MIXERS[type(m).__name__] for m in model.modules()
                    if type(m).__name__ in MIXERS})
    if not kinds or Version(installed) >= Version(VERIFIED_TRANSFORMERS):
        return None
    return InvalidArgument(
        f"model: its {' and '.join(kinds)} layers need transformers >= "
        f"{VERIFIED_TRANSFORMERS} (installed: {installed}), the oldest this engine's "
        "training of them was checked against; upgrade transformers to serve this model")


def _known(module: nn.Module) -> str | None:
    """The layer kind of a mixer `PerDatum` can run: a class in `MIXERS` whose forward
    takes the pass's keyword arguments (an older transformers' mixers take no `**kwargs`,
    so a packed pass's boundaries never reach them: they cannot pack), or None."""
    kind = MIXERS.get(type(module).__name__)
    if kind is None:
        return None
    takes = inspect.signature(type(module).forward).parameters.values()
    return kind if any(p.kind is p.VAR_KEYWORD for p in takes) else None


def install(model: nn.Module, router: Router) -> dict[str, str]:
    """Make every mixer of a kind in `MIXERS` run per datum in packed passes; returns
    {module name: layer kind} of those it changed."""
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        kind = _known(module)
        if kind is not None:
            # An instance attribute: `nn.Module.__call__` runs it in place of the class's
            # forward, and the module's parameters and names stay as they are.
            module.forward = PerDatum(module.forward, router)
            found[name] = kind
    return found


def unpackable(model: nn.Module) -> str | None:
    """The class name of a layer of `model` that carries state along the sequence and
    that `PerDatum` cannot run (a packed pass would carry it from one datum into the
    next), or None."""
    for module in model.modules():
        if _known(module) is not None:
            continue
        name = type(module).__name__
        if any(mark in name for mark in _STATEFUL_NAMES) or any(
                _causal_depthwise(child) for child in module.children()):
            return name
    return None


def _causal_depthwise(module: nn.Module) -> bool:
    """A conv1d over the sequence, one filter per channel, padded to stay causal: the
    short convolution of Mamba and linear-attention layers."""
    return (isinstance(module, nn.Conv1d) and module.groups == module.in_channels > 1
            and module.padding == (module.kernel_size[0] - 1,))


def peft_refused(model: nn.Module, names: Sequence[str]) -> frozenset[str]:
    """The layers among `names` (module names of `model`) that PEFT refuses LoRA on, so an
    export targeting them would not load: for Mamba models (nemotron_h, mamba2, ...)
    every `out_proj` and `conv1d`, which fused Mamba kernels read as raw weights, past any
    LoRA. PEFT's own check decides (`_check_lora_target_modules_mamba`, PEFT 0.21)."""
    from peft import LoraConfig
    from peft.tuners import tuners_utils

    check = getattr(tuners_utils, "_check_lora_target_modules_mamba", None)
    if check is None:  # a PEFT without the rule refuses nothing
        return frozenset()
    config = LoraConfig()
    refused = set()
    for name in names:
        try:
            check(config, model, name.rsplit(".", 1)[-1])
        except ValueError:
            refused.add(name)
    return frozenset(refused)
