"""Multi-LoRA linear layers: one base projection per batch, each adapter's delta on its rows.

For a batch whose rows belong to different adapters, every targeted linear layer computes

    y = W0 x                                  for all rows at once (frozen base)
    y[rows of a] += s_a * B_a A_a dropout_a(x[rows of a])   for each adapter a

with `A_a: [r_a, in]`, `B_a: [out, r_a]`, `s_a = alpha_a / r_a` (or `/ sqrt(r_a)` with rsLoRA).

Layout: each `MultiLoraLinear` keeps a dict `adapter id -> LoraWeights` (plain dict, so the
base model's own state dict is unchanged); the `LoraWeights` objects belong to the engine's
adapter records and are only referenced here. Which rows belong to which adapter is held
once, by the `Router` shared by every layer of the model: a list of contiguous row
segments set for the duration of one forward pass. A single segment covering the batch is
the fast path (no indexing); rows of no adapter get the base projection only.

Rows never mix: each row is its own sequence, so an adapter's output and gradient depend
only on its own rows.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import LoraSpec


@dataclass(frozen=True)
class Segment:
    """Rows `[start, end)` of the batch use adapter `adapter_id` (None: base only)."""

    adapter_id: str | None
    start: int
    end: int


class Router:
    """The row -> adapter assignment every `MultiLoraLinear` of one model reads."""

    def __init__(self) -> None:
        self.segments: tuple[Segment, ...] = ()

    @contextlib.contextmanager
    def route(self, row_adapter_ids: Sequence[str | None]) -> Iterator[None]:
        """Within this block, batch row i uses adapter `row_adapter_ids[i]`.

        Rows of one adapter must be contiguous; raises ValueError if an adapter's rows
        are split, since the layers slice by segment.
        """
        segments: list[Segment] = []
        for row, adapter_id in enumerate(row_adapter_ids):
            if segments and segments[-1].adapter_id == adapter_id:
                last = segments[-1]
                segments[-1] = Segment(adapter_id, last.start, row + 1)
            else:
                if adapter_id is not None and any(s.adapter_id == adapter_id for s in segments):
                    raise ValueError(f"rows of adapter {adapter_id!r} are not contiguous")
                segments.append(Segment(adapter_id, row, row + 1))
        previous, self.segments = self.segments, tuple(segments)
        try:
            yield
        finally:
            self.segments = previous


class LoraWeights(nn.Module):
    """One adapter's low-rank pair for one linear layer: `delta(x) = s * B(A(dropout(x)))`."""

    def __init__(self, in_features: int, out_features: int, spec: LoraSpec,
                 generator: torch.Generator, device: torch.device) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(torch.empty(spec.rank, in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, spec.rank, device=device))
        # PEFT's default init: A kaiming-uniform with a = sqrt(5), B zeros (delta starts at 0).
        bound = 1.0 / math.sqrt(in_features)
        with torch.no_grad():
            values = torch.rand(self.lora_A.shape, generator=generator) * 2 * bound - bound
            self.lora_A.copy_(values.to(device))
        self.scaling = spec.scaling
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x.to(self.lora_A.dtype))
        return F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


class MultiLoraLinear(nn.Module):
    """A frozen `nn.Linear` plus the LoRA deltas of every adapter that targets it."""

    def __init__(self, base_layer: nn.Linear, router: Router) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.router = router
        self.adapters: dict[str, LoraWeights] = {}

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        segments = [s for s in self.router.segments if s.adapter_id in self.adapters]
        if not segments:
            return out
        if len(segments) == 1 and segments[0].start == 0 and segments[0].end == x.shape[0]:
            return out + self.adapters[segments[0].adapter_id](x).to(out.dtype)
        pieces, cursor = [], 0
        for seg in segments:
            if seg.start > cursor:
                pieces.append(out[cursor:seg.start])
            delta = self.adapters[seg.adapter_id](x[seg.start:seg.end])
            pieces.append(out[seg.start:seg.end] + delta.to(out.dtype))
            cursor = seg.end
        if cursor < out.shape[0]:
            pieces.append(out[cursor:])
        return torch.cat(pieces, dim=0)


def inject(model: nn.Module, router: Router) -> dict[str, MultiLoraLinear]:
    """Wrap every `nn.Linear` of `model` in a `MultiLoraLinear`; returns them by module name.

    Wrapping all linears once at load time (rather than per adapter) keeps adapter
    add/remove a dict operation; a layer no adapter targets costs one empty-list check.
    """
    layers: dict[str, MultiLoraLinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                full = f"{name}.{child_name}" if name else child_name
                wrapper = MultiLoraLinear(child, router)
                setattr(module, child_name, wrapper)
                layers[full] = wrapper
    return layers


def resolve_targets(layers: dict[str, MultiLoraLinear], spec: LoraSpec,
                    output_layer: str) -> list[str]:
    """Names of the layers `spec.target_modules` selects, with PEFT's matching rules.

    `'all-linear'` is every linear except the output head (as in PEFT); any other string
    is a full-match regex; a tuple lists module-name suffixes. A target that matches
    nothing raises InvalidArgument naming it.
    """
    names = sorted(layers)
    targets = spec.target_modules
    if targets == "all-linear":
        return [n for n in names if n != output_layer]
    if isinstance(targets, str):
        chosen = [n for n in names if re.fullmatch(targets, n)]
        if not chosen:
            raise InvalidArgument(_no_match(targets, names))
        return chosen
    chosen = []
    for target in targets:
        hits = [n for n in names if n == target or n.endswith(f".{target}")]
        if not hits:
            raise InvalidArgument(_no_match(target, names))
        chosen.extend(hits)
    return sorted(set(chosen))


def _no_match(target: str, names: list[str]) -> str:
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in names})
    return (f"lora.target_modules: {target!r} matches no linear layer of the base model; "
            f"available module names end in {suffixes} (or use 'all-linear')")
