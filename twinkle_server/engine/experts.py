"""LoRA on MoE experts: per expert, low rank, on the tokens routed to that expert.

In transformers 5 an MoE layer's experts are one module holding fused parameters, not
linears (`Qwen3MoeExperts`: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`), declared
through `transformers.integrations.moe.use_experts_implementation`, which records the
layout on the module (`has_gate`, `has_bias`, `is_transposed`, `has_post_expert_norm`,
`_apply_gate`, `act_fn`). Every family issue 44 names uses it: qwen3_moe, qwen3_next,
qwen3_5_moe, glm4_moe (routed experts; its shared experts are linears), gpt_oss
(transposed, biases, a clamped SwiGLU over interleaved gate/up), nemotron_h (`up_proj`,
no gate, relu2). This module reads those flags, so it is one code path for all of them.

For expert e and the tokens `x_e` routed to it, each targeted projection computes

    y = W_e x_e (+ b_e)                                   every routed token (frozen base)
    y[tokens of a] += s_a * B_a,e A_a,e x_e[tokens of a]  for each adapter a in the pass

with `A_a,e: [r, in]`, `B_a,e: [out, r]`, never forming `B A` (an expert stack's size per
tenant). Which positions belong to which adapter is the `lora.Router`'s segments, as for
the linear layers (ROWS or TOKENS axis): the experts see the flattened `[positions * per,
hidden]` tokens, and a token routed to e keeps its position, so each adapter's tokens are
one contiguous run within each expert's. The router (gate) is not trained: it is a frozen
linear the adapters never target; gradients reach the routing weights only as they reach
any activation.

Parameter layout (`ExpertLoraWeights`) is PEFT's `ParamWrapper`'s (peft 0.21, for
`LoraConfig.target_parameters`), so checkpoints are written and read unchanged:
`lora_A: [E * r, in]` (expert e's rows `e*r : (e+1)*r`) and `lora_B: [out, r * E]`
(expert e's columns `e, e + E, e + 2E, ...`), scaled by `alpha / r` with r per expert.
PEFT nests one wrapper per targeted parameter of a module in the module's parameter
order, so its saved keys name the module with `.base_layer` once per wrapper outside:
targeting `gate_up_proj` and `down_proj` saves `...experts.base_layer.lora_A.weight`
(gate_up) and `...experts.lora_A.weight` (down). An adapter keeps its expert weights
under those module paths (`peft_module`), beside its linears' names.

An adapter's dropout applies to each expert's routed tokens in training, as on a linear
(`B_e A_e dropout(x_e)`). PEFT refuses dropout on parameter targets, so checkpoints'
configs record 0 and keep the adapter's own beside it (`checkpoint.write_peft`): dropout
changes no output outside training.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn
from torch.nn import functional as F

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.lora import Router
from twinkle_server.engine.types import ROLE_MLP, LoraSpec

PROJECTIONS: dict[str, frozenset[str]] = {
    "gate_up_proj": frozenset({"gate_up_proj", "gate_proj", "up_proj"}),
    "up_proj": frozenset({"up_proj"}),
    "down_proj": frozenset({"down_proj"}),
}
"""An experts module's projection parameter -> the `target_modules` names (Tinker's
`train_mlp` names, or the fused name itself) that select it on every expert."""
_LAYOUT_FLAGS = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")
"""Set on an experts module by transformers' `use_experts_implementation`: its layout."""


class ExpertLoraWeights(nn.Module):
    """One adapter's per-expert low-rank pairs on one projection of one experts module.

    `lora_A: [E * r, in]`, `lora_B: [out, r * E]`, float32, in PEFT's `ParamWrapper`
    layout (module docstring); `delta(x, e) = s * B_e A_e x`. `parameter` is the base's
    parameter name (`model.layers.1.mlp.experts.gate_up_proj`), `peft_module` the module
    path PEFT saves its matrices under. Initialised as PEFT does: `lora_A` kaiming-uniform
    (`±1/sqrt(in)`) from `generator`, `lora_B` zeros.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, spec: LoraSpec,
                 generator: torch.Generator, parameter: str, peft_module: str,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        rows = num_experts * spec.rank
        bound = 1.0 / math.sqrt(in_features)
        a = (torch.rand((rows, in_features), generator=generator) * 2 - 1) * bound
        self.lora_A = nn.Parameter(a.to(device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rows, device=device))
        self.num_experts, self.rank, self.scaling = num_experts, spec.rank, spec.scaling
        self.dropout_p = float(spec.dropout)
        self.parameter, self.peft_module = parameter, peft_module

    def delta(self, x: torch.Tensor, expert: int, train: bool = False) -> torch.Tensor:
        """`s * B_e A_e dropout(x)` for tokens `x: [n, in]` routed to `expert`, in
        float32; dropout only where `train` (a training forward's segment)."""
        if train and self.dropout_p > 0:
            x = F.dropout(x, self.dropout_p, training=True)
        a = self.lora_A.view(self.num_experts, self.rank, -1)[expert]
        b = self.lora_B.view(self.lora_B.shape[0], self.rank, self.num_experts)[:, :, expert]
        return F.linear(F.linear(x.to(a.dtype), a) * self.scaling, b)


class MultiLoraExperts:
    """An experts module of the base whose forward adds every routed adapter's deltas.

    Installed over the module's own forward (the base module and its parameters stay
    where they are, so the base's state dict is unchanged). `adapters[projection]` maps
    adapter id -> `ExpertLoraWeights` (references, owned by the engine's `Adapter`). With
    no adapter routed on this module the module's own forward (its experts
    implementation) runs; otherwise the per-expert loop below, which computes the base
    as transformers' eager loop does.
    """

    def __init__(self, module: nn.Module, name: str, router: Router) -> None:
        self.module, self.name, self.router = module, name, router
        params = dict(module.named_parameters(recurse=False))
        self.projections = tuple(p for p in params if p in PROJECTIONS)
        self.adapters: dict[str, dict[str, ExpertLoraWeights]] = {
            p: {} for p in self.projections}
        self._base_forward = module.forward
        module.forward = self.forward

    @property
    def num_experts(self) -> int:
        return int(getattr(self.module, self.projections[0]).shape[0])

    def features(self, projection: str) -> tuple[int, int]:
        """`(in, out)` of one expert's `projection`."""
        shape = getattr(self.module, projection).shape
        return (int(shape[1]), int(shape[2])) if self.module.is_transposed else (
            int(shape[2]), int(shape[1]))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """The experts' output `[tokens, hidden]` for flattened `hidden`, with each routed
        adapter's deltas on its own tokens."""
        segments = self.router.segments
        routed = {p: [table.get(s.adapter_id) if s.adapter_id else None for s in segments]
                  for p, table in self.adapters.items()}
        if not any(w is not None for ws in routed.values() for w in ws):
            return self._base_forward(hidden, top_k_index, top_k_weights)
        positions = segments[-1].end
        if hidden.shape[0] % positions:
            raise ValueError(f"router: segments cover {positions} positions but the experts "
                             f"of {self.name} got {hidden.shape[0]} tokens; route every row "
                             "(or every packed token) of the batch")
        per = hidden.shape[0] // positions
        ends = torch.tensor([s.end * per for s in segments], device=top_k_index.device)
        module, out = self.module, torch.zeros_like(hidden)
        first = "gate_up_proj" if module.has_gate else "up_proj"
        for expert in torch.unique(top_k_index).tolist():
            if expert >= self.num_experts:   # expert-parallel sentinel: not this rank's
                continue
            # Row-major: the expert's tokens in position order, so each adapter's are a run.
            tokens, slot = torch.where(top_k_index == expert)
            cuts = torch.searchsorted(tokens, ends).tolist()
            sizes = [b - a for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
            h = self._project(first, hidden[tokens], expert, sizes, routed)
            h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
            h = self._project("down_proj", h, expert, sizes, routed)
            if module.has_post_expert_norm:
                h = module.post_expert_norm(h)
            h = h * top_k_weights[tokens, slot, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        return out

    def _project(self, projection: str, x: torch.Tensor, expert: int, sizes: list[int],
                 routed: dict[str, list[ExpertLoraWeights | None]]) -> torch.Tensor:
        """Expert `expert`'s `projection` of its tokens `x`, plus each adapter's delta on
        its run of them (`sizes`, one per router segment)."""
        module = self.module
        weight = getattr(module, projection)[expert]
        y = x @ weight if module.is_transposed else F.linear(x, weight)
        if module.has_bias:
            y = y + getattr(module, f"{projection}_bias")[expert]
        loras = routed.get(projection)
        if not loras or all(w is None for w in loras):
            return y
        pieces = x.split(sizes)
        trains = [s.train for s in self.router.segments]
        deltas = [w.delta(piece, expert, train).to(y.dtype) if w is not None
                  else y.new_zeros((piece.shape[0], y.shape[-1]))
                  for w, piece, train in zip(loras, pieces, trains, strict=True)]
        return y + torch.cat(deltas)


@dataclass(frozen=True)
class ExpertsLayers:
    """The base's experts modules: `served` by name (wrapped), and `unserved` ones (3D
    expert projections without transformers' experts interface) as name -> (class name,
    projection names), refused when an adapter would target them."""

    served: dict[str, MultiLoraExperts]
    unserved: dict[str, tuple[str, tuple[str, ...]]]


def inject(model: nn.Module, router: Router) -> ExpertsLayers:
    """Wrap every experts module of `model` (see `ExpertsLayers`)."""
    served: dict[str, MultiLoraExperts] = {}
    unserved: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name, module in model.named_modules():
        stacked = tuple(p for p, t in module.named_parameters(recurse=False)
                        if t.dim() == 3 and p in PROJECTIONS)
        if not stacked:
            continue
        if (all(hasattr(module, flag) for flag in _LAYOUT_FLAGS) and "down_proj" in stacked
                and not getattr(module, "_is_expert_parallel", False)):
            served[name] = MultiLoraExperts(module, name, router)
        else:
            unserved[name] = (type(module).__name__, stacked)
    return ExpertsLayers(served, unserved)


@dataclass(frozen=True)
class ExpertTarget:
    """One projection of one experts module an adapter trains."""

    layer: str
    projection: str
    peft_module: str

    @property
    def parameter(self) -> str:
        return f"{self.layer}.{self.projection}"


def _matches(parameter: str, pattern: str) -> bool:
    """PEFT's `target_parameters` rule: the full name or a dotted suffix of it."""
    return parameter == pattern or parameter.endswith(f".{pattern}")


def targets(layers: ExpertsLayers, spec: LoraSpec) -> list[ExpertTarget]:
    """The expert projections `spec` trains: those its `target_parameters` name (PEFT's
    rule), or, without them, those its `target_modules` name by a projection name
    (`PROJECTIONS`), or by Tinker's `train_mlp` (`ROLE_MLP`: every expert projection);
    a regex or 'all-linear' names linears only, as in PEFT.

    Raises InvalidArgument naming the field when no `target_parameters` entry matches an
    expert projection (the router's and other parameters are not trained), when the
    experts it would train are not computed by this engine (by class).
    """
    explicit = None if spec.target_parameters is None else split_parameters(
        spec.target_parameters)[1]
    named = frozenset() if isinstance(spec.target_modules, str) else frozenset(
        spec.target_modules)

    def selects(layer: str, projection: str) -> bool:
        if explicit is None:
            return ROLE_MLP in named or bool(PROJECTIONS[projection] & named)
        return any(_matches(f"{layer}.{projection}", pattern) for pattern in explicit)

    everything = [f"{layer}.{p}" for layer, m in layers.served.items() for p in m.projections]
    everything += [f"{layer}.{p}" for layer, (_, ps) in layers.unserved.items() for p in ps]
    # As peft: one pattern of several may match nothing, but some must match.
    if explicit and not any(_matches(n, pattern) for n in everything for pattern in explicit):
        raise InvalidArgument(
            f"lora.target_parameters: {list(explicit)} match no expert projection of the "
            f"base model (e.g. {everything[:2]}); the router and other parameters are not "
            "trained")
    refused = [(layer, cls) for layer, (cls, ps) in layers.unserved.items()
               if any(selects(layer, p) for p in ps)]
    if refused:
        raise InvalidArgument(
            f"lora.target_modules: the base's experts ({refused[0][1]} at {refused[0][0]!r}) "
            "are not computed by this engine's expert LoRA; target no MLP projections "
            "(train_mlp false) on this model")
    chosen = {layer: [p for p in m.projections if selects(layer, p)]
              for layer, m in sorted(layers.served.items())}
    out = [ExpertTarget(layer, p, layer + ".base_layer" * (len(ps) - 1 - depth))
           for layer, ps in chosen.items() for depth, p in enumerate(ps)]
    return out


def split_parameters(parameters: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """PEFT `target_parameters` as `(linears, expert projections)`: an entry
    `<module>.weight` is a linear's weight (LoRA on it is LoRA on the linear; how
    `checkpoint.peft_targets` writes linears peft would read as experts), any other
    names expert projections."""
    linears = tuple(p.removesuffix(".weight") for p in parameters if p.endswith(".weight"))
    return linears, tuple(p for p in parameters if not p.endswith(".weight"))


def linear_spec(spec: LoraSpec, linears: Iterable[str], layers: ExpertsLayers) -> LoraSpec | None:
    """`spec` for the linear layers alone: with the linears its `target_parameters` name
    by their `.weight` (`split_parameters`), without the bare projection names that name
    only the experts here (all of a model's MLPs may be experts, and 'gate_proj' then
    names no linear); None when nothing is left for the linears."""
    if isinstance(spec.target_modules, str):
        return spec
    weights = split_parameters(spec.target_parameters or ())[0]
    names = list(linears)
    for module in weights:
        if not any(n == module or n.endswith(f".{module}") for n in names):
            raise InvalidArgument(
                f"lora.target_parameters: {module + '.weight'!r} is the weight of no linear "
                "layer of the base model (and names no expert projection); the router and "
                "other parameters are not trained")
    if weights:
        spec = replace(spec, target_modules=tuple(sorted({*spec.target_modules, *weights})))
    if not spec.target_modules and spec.target_parameters:   # PEFT's parameter targets only
        return None
    if not layers.served:
        return spec
    suffixes = {n.rsplit(".", 1)[-1] for n in names}
    # Every MLP projection name: on a model with experts, one that names no linear names
    # the experts or nothing of theirs (nemotron_h's relu2 experts have no gate).
    expert_names = set().union(*PROJECTIONS.values())
    kept = tuple(n for n in spec.target_modules
                 if n not in expert_names or n in suffixes or "." in n)
    if kept == tuple(spec.target_modules):
        return spec
    return replace(spec, target_modules=kept) if kept else None


def new_weights(layers: ExpertsLayers, chosen: Sequence[ExpertTarget], spec: LoraSpec,
                generator: torch.Generator, device: torch.device | str
                ) -> dict[str, ExpertLoraWeights]:
    """Fresh weights for `chosen`, by PEFT module path."""
    out = {}
    for target in chosen:
        experts = layers.served[target.layer]
        fan_in, fan_out = experts.features(target.projection)
        out[target.peft_module] = ExpertLoraWeights(
            experts.num_experts, fan_in, fan_out, spec, generator, target.parameter,
            target.peft_module, device)
    return out


def attach(layers: ExpertsLayers, adapter_id: str, weights: dict[str, nn.Module]) -> None:
    """Route `adapter_id`'s expert weights (those of `weights`) into their modules."""
    for w in weights.values():
        if isinstance(w, ExpertLoraWeights):
            layer, projection = w.parameter.rsplit(".", 1)
            layers.served[layer].adapters[projection][adapter_id] = w


def detach(layers: ExpertsLayers, adapter_id: str) -> None:
    """Remove `adapter_id` from every experts module."""
    for experts in layers.served.values():
        for table in experts.adapters.values():
            table.pop(adapter_id, None)


def parameter_count(layers: ExpertsLayers, chosen: Sequence[ExpertTarget], rank: int) -> int:
    """Trainable numbers of `chosen` at `rank`: `E * r * (in + out)` per projection."""
    total = 0
    for target in chosen:
        experts = layers.served[target.layer]
        fan_in, fan_out = experts.features(target.projection)
        total += experts.num_experts * rank * (fan_in + fan_out)
    return total
