"""Tinker's LoRA switches by role: which linears of a loaded model are its attention, its
MLP and its output head.

Tinker's `LoraConfig` has three switches, `train_attn`, `train_mlp` and `train_unembed`,
that mean the same on every architecture, where module names do not (Llama's `q_proj`,
Phi-3's fused `qkv_proj` and `gate_up_proj`, Qwen3-Next's `in_proj_qkvz`, Nemotron-H's
Mamba `in_proj`). `LoraSpec.from_tinker` therefore names roles (`types.ROLE_TARGETS`), and
they are resolved here against the loaded model's structure:

- `attention`: every linear of a decoder layer's token mixer: self-attention (q, k, v, o,
  a fused `qkv_proj`), linear attention (Gated DeltaNet's `in_proj_qkvz`, `in_proj_ba`,
  `in_proj_qkv`, `in_proj_z`, `in_proj_a`, `in_proj_b`, `out_proj`), Mamba's `in_proj`
  and `out_proj` (the engine leaves Mamba's `out_proj` out: PEFT refuses LoRA on it,
  `recurrent.peft_refused`), LFM2's gated short convolution (`in_proj`, `out_proj`);
- `mlp`: every linear of a decoder layer's MLP: gate, up, down, a fused `gate_up_proj`,
  and the shared experts' linears of an MoE block;
- `unembed`: the output head.

Routers are never trained, under any switch: a linear of an MLP named `gate`, `router` or
`*_gate` (Qwen3-Next's `shared_expert_gate`) stays frozen, as do routers that are not
linears at all (`mlp.gate` of Qwen3-MoE or GLM-4-MoE). A decoder layer's child (`self_attn`,
`linear_attn`, `mlp`, Nemotron-H's `mixer`) is a token mixer or an MLP by its class name:
`TOKEN_MIXER_WORDS` first (so `Qwen3_5MoeGatedDeltaNet` is a mixer), then `MLP_WORDS`. A
linear in no known part takes no role, and is named when the switches select nothing.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping

from torch import nn

from twinkle_server.engine.types import ROLE_ATTENTION, ROLE_MLP, ROLE_UNEMBED

ROUTER = "router"
"""The role of a router linear: never trained."""
TOKEN_MIXER_WORDS = ("Attention", "Mamba", "Mixer", "DeltaNet", "SSM", "ShortConv")
MLP_WORDS = ("MLP", "Mlp", "MoE", "Moe", "FeedForward", "Expert")
_ROUTER_LEAF = re.compile(r"(gate|router|.*_gate)")
# `<...>.layers.<i>.<part>.<...>.<leaf>`: the part of a decoder layer a linear sits in (the
# first index in the name is the decoder layer's; experts' indices come after the part).
_IN_LAYER = re.compile(r"^(?P<layer>.*?\.\d+)\.(?P<part>[^.]+)\.(?:.*\.)?(?P<leaf>[^.]+)$")


def layer_roles(model: nn.Module, linears: Iterable[str], output_layer: str
                ) -> dict[str, str | None]:
    """Each linear's role by name: `ROLE_ATTENTION`, `ROLE_MLP`, `ROLE_UNEMBED`, `ROUTER`
    (never trained), or None (in no part the switches know)."""
    kinds: dict[str, str | None] = {}
    roles: dict[str, str | None] = {}
    for name in linears:
        if name == output_layer:
            roles[name] = ROLE_UNEMBED
            continue
        found = _IN_LAYER.match(name)
        if found is None:
            roles[name] = None
            continue
        part = f"{found['layer']}.{found['part']}"
        if part not in kinds:
            kinds[part] = _part_kind(type(model.get_submodule(part)).__name__)
        kind = kinds[part]
        roles[name] = (ROUTER if kind == ROLE_MLP and _ROUTER_LEAF.fullmatch(found["leaf"])
                       else kind)
    return roles


def _part_kind(class_name: str) -> str | None:
    """A decoder layer part's role from its class name (module docstring)."""
    if any(word in class_name for word in TOKEN_MIXER_WORDS):
        return ROLE_ATTENTION
    if any(word in class_name for word in MLP_WORDS):
        return ROLE_MLP
    return None


def by_role(roles: Mapping[str, str | None], wanted: Iterable[str]) -> dict[str, list[str]]:
    """The linears of each wanted role (sorted; a role the model lacks maps to [])."""
    return {role: sorted(n for n, r in roles.items() if r == role) for role in wanted}


def describe(roles: Mapping[str, str | None], left_out: Collection[str] = ()) -> str:
    """How many linears each role's switch trains, those it leaves out (`left_out`: the
    engine's `peft_refused`) and the routers left frozen: for logs and errors."""
    kept = {n: r for n, r in roles.items() if n not in left_out}
    counts = {role: len(names) for role, names in
              by_role(kept, (ROLE_ATTENTION, ROLE_MLP, ROLE_UNEMBED)).items()}
    routers = sorted({n.rsplit(".", 1)[-1] for n, r in roles.items() if r == ROUTER})
    other = sorted({n.rsplit(".", 1)[-1] for n, r in kept.items() if r is None})
    refused = sorted({n.rsplit(".", 1)[-1] for n in left_out if n in roles})
    text = ", ".join(f"{role.removeprefix('role:')} {count}" for role, count in counts.items())
    if refused:
        text += (f"; left out, PEFT refuses LoRA on them: {', '.join(refused)} "
                 f"({sum(n in roles for n in left_out)})")
    text += "; routers are never trained" + (f" ({', '.join(routers)})" if routers else "")
    return text + (f"; in no known part: {', '.join(other)}" if other else "")
