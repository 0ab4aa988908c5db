"""Multi-LoRA linear layers: one base projection per batch, each adapter's delta on its rows.

For a batch whose rows belong to different adapters, every targeted linear layer computes

    y = W0 x                                                  all rows at once (frozen base)
    y[rows of a] += s_a * B_a A_a dropout_a(x[rows of a])     for each adapter a in the batch

with `A_a: [r_a, in]`, `B_a: [out, r_a]`, `s_a = alpha_a / r_a` (or `alpha_a / sqrt(r_a)`
with rsLoRA). PEFT's own mixed-adapter batches are inference-only, so this layer is ours;
PEFT supplies the target-matching rules and the on-disk format.

Layout: each `MultiLoraLinear` keeps a plain dict `adapter id -> LoraWeights` (a plain
dict, so the base model's `state_dict` never changes); the `LoraWeights` objects belong
to the engine's `Adapter` records and are only referenced here. Which positions belong to
which adapter is held once, by the `Router` shared by every layer of the model: a tuple of
contiguous `Segment`s set for the duration of one forward pass, along one axis:

- `ROWS` (`Router.route`): segments of the batch's rows, `x: [rows, seq, in]`: sampling,
  and merged passes with `--packing off` (every datum its own right-padded row);
- `TOKENS` (`Router.route_tokens`): segments of the tokens of one packed sequence,
  `x: [1, tokens, in]` (or the flat `[tokens, in]`): merged training passes, whose
  datums sit one after another in one row (`engine.packing`).

Either way each segment's delta is one matmul pair on that segment's slice, and the deltas
are added to the base projection in one go; positions of no adapter get the base only.

Datums never mix: each is its own sequence (its own row, or its own token range of a
packed row with attention confined to it), and the delta is per position, so an
adapter's output and gradient depend only on its own datums. Its delta is computed by the
same matmuls on the same positions as when it runs alone (a matmul batched over adapters
would sum in another order, and Adam turns such rounding into visible drift).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.roles import by_role, describe
from twinkle_server.engine.types import (
    ROLE_ATTENTION,
    ROLE_MLP,
    ROLE_TARGETS,
    ROLE_UNEMBED,
    LoraSpec,
)

ALL_LINEAR = "all-linear"


ROWS = 0
"""Router axis: segments index the batch's rows (`x: [rows, seq, in]`, dimension 0)."""
TOKENS = -2
"""Router axis: segments index the tokens of one packed sequence (`x: [1, tokens, in]` or
`[tokens, in]`: the dimension before the features)."""


@dataclass(frozen=True)
class Segment:
    """Positions `[start, end)` along the router's axis (batch rows, or the tokens of a
    packed sequence) use adapter `adapter_id` (None: base only).

    `train` switches the adapter's dropout on for these positions (training forward
    passes); evaluation and sampling never drop.
    """

    adapter_id: str | None
    start: int
    end: int
    train: bool = False


class Router:
    """The position -> adapter assignment every `MultiLoraLinear` of one model reads:
    `segments` along `axis` (`ROWS` or `TOKENS`), covering that axis end to end."""

    def __init__(self) -> None:
        self.segments: tuple[Segment, ...] = ()
        self.axis: int = ROWS

    def route(self, row_adapter_ids: Sequence[str | None],
              train_rows: Sequence[bool] | None = None
              ) -> contextlib.AbstractContextManager[None]:
        """Within this block, batch row i uses adapter `row_adapter_ids[i]` (None: base).

        `train_rows[i]` True applies dropout on row i (default: no row trains). The rows
        of one adapter must be contiguous: raises ValueError otherwise, since the layers
        slice by segment and the engine is the one that orders the batch.
        """
        return self._routed([1] * len(row_adapter_ids), row_adapter_ids, train_rows, ROWS)

    def route_tokens(self, lengths: Sequence[int], adapter_ids: Sequence[str | None],
                     train: Sequence[bool] | None = None
                     ) -> contextlib.AbstractContextManager[None]:
        """Within this block, the batch is ONE packed sequence whose next `lengths[i]`
        tokens use adapter `adapter_ids[i]` (None: base), with dropout where `train[i]`.

        Consecutive runs of the same adapter and train flag become one segment (one
        matmul pair per layer). An adapter's runs must be contiguous: raises ValueError
        otherwise, as for `route`.
        """
        return self._routed(lengths, adapter_ids, train, TOKENS)

    @contextlib.contextmanager
    def _routed(self, lengths: Sequence[int], adapter_ids: Sequence[str | None],
                train: Sequence[bool] | None, axis: int) -> Iterator[None]:
        flags = list(train) if train is not None else [False] * len(adapter_ids)
        if not len(lengths) == len(adapter_ids) == len(flags):
            raise ValueError(f"route: {len(lengths)} lengths, {len(adapter_ids)} adapter ids "
                             f"and {len(flags)} train flags; give one of each per run")
        segments: list[Segment] = []
        start = 0
        for size, adapter_id, run_train in zip(lengths, adapter_ids, flags, strict=True):
            if size < 1:
                raise ValueError(f"route: a run of adapter {adapter_id!r} has {size} "
                                 "positions; every run needs at least one")
            last = segments[-1] if segments else None
            end = start + size
            if last is not None and (last.adapter_id, last.train) == (adapter_id, run_train):
                segments[-1] = Segment(adapter_id, last.start, end, run_train)
            elif (adapter_id is not None and last is not None and last.adapter_id != adapter_id
                    and any(s.adapter_id == adapter_id for s in segments)):
                raise ValueError(f"rows of adapter {adapter_id!r} are not contiguous")
            else:
                segments.append(Segment(adapter_id, start, end, run_train))
            start = end
        previous = self.segments, self.axis
        self.segments, self.axis = tuple(segments), axis
        try:
            yield
        finally:
            self.segments, self.axis = previous


def adapter_order(adapter_ids: Sequence[str | None]) -> list[int]:
    """Indices of a batch's requests grouped by adapter (stable, by first appearance): the
    router needs each adapter's rows contiguous, and a single-adapter batch becomes one
    fast segment."""
    first_seen: dict[str | None, int] = {}
    for adapter_id in adapter_ids:
        first_seen.setdefault(adapter_id, len(first_seen))
    return sorted(range(len(adapter_ids)), key=lambda i: first_seen[adapter_ids[i]])


class LoraWeights(nn.Module):
    """One adapter's low-rank pair on one linear layer: `delta(x) = s * B A dropout(x)`.

    Parameters are float32 whatever the base dtype (`lora_A: [rank, in]`,
    `lora_B: [out, rank]`), so AdamW state and small updates keep full precision on a
    bf16 base; inputs are cast up and the delta cast back by the layer.

    Initialisation is PEFT's: `A` kaiming-uniform with `a = sqrt(5)` (uniform in
    `±1/sqrt(in)`), `B` zeros, so a new adapter leaves the base model unchanged. `A` is
    drawn from `generator`, so the same `LoraSpec.seed` gives the same adapter.
    """

    def __init__(self, in_features: int, out_features: int, spec: LoraSpec,
                 generator: torch.Generator, device: torch.device | str = "cpu") -> None:
        super().__init__()
        # kaiming_uniform_(a=sqrt(5)): gain sqrt(2/(1+5)) * sqrt(3/fan_in) = 1/sqrt(fan_in).
        bound = 1.0 / math.sqrt(in_features)
        a = (torch.rand((spec.rank, in_features), generator=generator) * 2 - 1) * bound
        self.lora_A = nn.Parameter(a.to(device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, spec.rank, device=device))
        self.scaling = spec.scaling
        self.dropout_p = float(spec.dropout)

    def delta(self, x: torch.Tensor, train: bool = False) -> torch.Tensor:
        """`s * B A dropout(x)`, the scale applied to the rank-r intermediate, where it is
        smallest."""
        x = x.to(self.lora_A.dtype)
        if train and self.dropout_p > 0:
            x = F.dropout(x, self.dropout_p, training=True)
        return F.linear(F.linear(x, self.lora_A) * self.scaling, self.lora_B)


class MultiLoraLinear(nn.Module):
    """A frozen `nn.Linear` plus the LoRA deltas of every adapter that targets it.

    `forward(x)` with `x: [batch, seq, in]` (or `[tokens, in]` under `TOKENS` routing, or
    `[batch * seq, in]` flattened row by row under `ROWS`, as MoE blocks feed shared experts)
    returns `W0 x (+ bias)` everywhere plus, for each router segment whose adapter targets
    this layer, that adapter's delta on the segment's slice of the router's axis.
    `adapters` maps adapter id -> `LoraWeights` (references, not owned). Raises ValueError
    when the segments do not cover that axis exactly.
    """

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
        segments = self.router.segments
        if (self.router.axis == ROWS and x.dim() == 2 and segments
                and x.shape[0] != segments[-1].end and x.shape[0] % segments[-1].end == 0):
            # An MoE block feeds its shared expert the batch flattened row by row to
            # [rows * seq, in] (qwen3_next, qwen3_5_moe): routed by rows, they are the
            # batch's rows again.
            rows = x.reshape(segments[-1].end, -1, x.shape[-1])
            return self.forward(rows).reshape(x.shape[0], -1)
        out = self.base_layer(x)
        weights = [self.adapters.get(seg.adapter_id) if seg.adapter_id else None
                   for seg in segments]
        if not any(weights):
            return out
        dim = self.router.axis
        if segments[-1].end != x.shape[dim]:
            raise ValueError(f"router: segments cover {segments[-1].end} positions but the "
                             f"input has {x.shape[dim]} along dimension {dim}; route every "
                             "row (or every packed token) of the batch")
        if not torch.is_grad_enabled() and not any(seg.train for seg in segments) and all(
                lora is None or lora.lora_A.dtype == x.dtype == out.dtype for lora in weights):
            return self._add_deltas(x, out, segments, weights, dim)
        # One split into every segment's slice: its gradient is one concatenation, where a
        # slice per adapter would each scatter into a zeroed gradient of the whole batch.
        sizes = [seg.end - seg.start for seg in segments]
        pieces = (x,) if len(segments) == 1 else x.split(sizes, dim)
        # The same matmuls on the same positions as the adapter alone: its delta comes out
        # as it would alone.
        deltas = [lora.delta(piece, seg.train).to(out.dtype) if lora is not None
                  else out.new_zeros((*piece.shape[:-1], out.shape[-1]))
                  for seg, lora, piece in zip(segments, weights, pieces, strict=True)]
        # One add over the whole batch; the deltas' concatenation costs a copy, but its
        # gradient is free slicing (writing each delta into `out` in place would clone the
        # whole gradient once per adapter in the backward pass).
        return out + (deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim))

    @staticmethod
    def _add_deltas(x: torch.Tensor, out: torch.Tensor, segments: Sequence[Segment],
                    weights: Sequence[LoraWeights | None], dim: int) -> torch.Tensor:
        """Without autograd (sampling, scoring), each delta is added into `out` in place
        by one `addmm` with the scale as its `alpha`: per layer and segment two matrix
        products, where the path above also runs a scaling, an addition and the deltas'
        concatenation. Sums differ from it by float32 rounding only."""
        for seg, lora in zip(segments, weights, strict=True):
            if lora is None:
                continue
            piece = x.narrow(dim, seg.start, seg.end - seg.start)
            into = out.narrow(dim, seg.start, seg.end - seg.start)
            low = F.linear(piece, lora.lora_A).reshape(-1, lora.lora_A.shape[0])
            into.view(-1, out.shape[-1]).addmm_(low, lora.lora_B.t(), alpha=lora.scaling)
        return out


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


def resolve_targets(layers: Iterable[str], spec: LoraSpec, output_layer: str | None,
                    roles: Mapping[str, str | None] | None = None,
                    allow_empty: bool = False) -> list[str]:
    """Names of the linear layers (of those named `layers`) `spec.target_modules`
    selects, with PEFT's own matching rules, or by role.

    `'all-linear'` is every linear except the output head (`output_layer`), as PEFT's
    `_maybe_include_all_linear_layers` does; any other string is a full-match regex; a
    tuple lists names or dotted suffixes (`peft.tuners.tuners_utils.
    check_target_module_exists`). Each pattern that matches nothing raises
    InvalidArgument naming it and a few available module names.

    Entries of `ROLE_TARGETS` (Tinker's switches, `LoraSpec.from_tinker`) select the
    linears of that role in `roles` (`engine.roles.layer_roles`; routers never). A role
    the model has no linear of is no error when another entry selects something: a spec
    that selects nothing at all is refused, naming each role's count, unless
    `allow_empty` (the switches select MoE experts, `engine.experts`, and no linear).
    """
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    names = sorted(layers)
    targets = spec.target_modules
    if isinstance(targets, str) and targets.lower() == ALL_LINEAR:
        return [n for n in names if n != output_layer]
    patterns = [targets] if isinstance(targets, str) else list(targets)
    if not patterns:
        raise InvalidArgument("lora.target_modules: is empty; list module names or use "
                              f"{ALL_LINEAR!r}")
    wanted_roles = [p for p in patterns if p in ROLE_TARGETS]
    chosen: set[str] = set()
    if wanted_roles:
        if roles is None:
            raise InvalidArgument(f"lora.target_modules: roles {wanted_roles} need the "
                                  "model's structure; give module names instead")
        for hits in by_role(roles, wanted_roles).values():
            chosen.update(n for n in hits if n in names)
    for pattern in patterns:
        if pattern in ROLE_TARGETS:
            continue
        config = LoraConfig(r=spec.rank, target_modules=pattern if isinstance(targets, str)
                            else [pattern])
        hits = [n for n in names if check_target_module_exists(config, n)]
        if not hits:
            raise InvalidArgument(_no_match(pattern, names))
        chosen.update(hits)
    if not chosen and not allow_empty:
        switches = ", ".join(f"train_{_SWITCH[r]}" for r in wanted_roles)
        raise InvalidArgument(
            f"lora: {switches} select no linear layer of this model "
            f"({describe(roles or {})}); the adapter would train nothing: turn on another "
            "switch or give target_modules")
    return sorted(chosen)


def named_patterns(targets: str | tuple[str, ...]) -> str | tuple[str, ...]:
    """The patterns of `target_modules` that name modules, not Tinker's roles or
    'all-linear' (empty when none do): those a user chose by name."""
    if isinstance(targets, str):
        return "" if targets.lower() == ALL_LINEAR else targets
    return tuple(t for t in targets if t not in ROLE_TARGETS)


_SWITCH = {ROLE_ATTENTION: "attn", ROLE_MLP: "mlp", ROLE_UNEMBED: "unembed"}


def _no_match(target: str, names: list[str]) -> str:
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in names})
    return (f"lora.target_modules: {target!r} matches no linear layer of the base model; "
            f"available module names end in {suffixes}, e.g. {names[:3]} "
            f"(or use {ALL_LINEAR!r})")
