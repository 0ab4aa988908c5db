"""What each decoder layer of a transformers config is made of, and what a training pass
keeps of it per token: the activation count of `engine.memory`, per layer kind.

A layer is a token mixer (full or sliding attention, Gated DeltaNet linear attention, a
Mamba2 mixer, LFM2's gated short convolution) and an MLP (dense, or MoE: routed experts plus shared experts), or, as
Nemotron-H's blocks, one of the four alone. Sizes are read per kind from the fields that
kind's configs carry, never from one field for all (Qwen3.5-MoE has no
`intermediate_size`). A kind, or a size a kind needs, the config does not give is refused
by name (InvalidArgument), never guessed.

Elements kept for backward per token, with H hidden, Q = heads x head_dim, K = kv heads x
head_dim (`engine.memory`'s reading of a Qwen3 layer, split by part; each part's norm
keeps its input and output, 2H, and upcasts its input on a bf16 base, H):

    attention      kept 2H + 6Q + K                      upcast 4H + 2Q + K
    dense MLP (I)  kept 2H + 4I                          upcast 3H + I
    MoE            kept 2H + kH + 4(k Ie + Is) + 2E      upcast H + 2kH + k Ie (+ 2H + Is)
                   (k experts a token of E, each Ie wide; shared experts Is wide:
                   a routed token's input is gathered once per expert it goes to)
    linear attn    kept 2H + 8Kl + 8Vl + 2h + c h        upcast 5H + Vl
                   (Kl, Vl key and value widths, h value heads; projections, the
                   causal conv's input and output, the gated norm; c = 64, the chunked
                   scan's [c x c] scores per head)
    Mamba2         kept 2H + 9D + 6GN + m + c m          upcast 2H + D
                   (D = heads x head dim, G groups, N state size, m heads; c = 128)
    short conv     kept 8H                               upcast 2H
                   (LFM2: the norm, in_proj's 3H output, the gated conv input and
                   output, the gated result out_proj reads)

Only the attention and dense MLP counts are measured (`engine.memory`); MoE, linear
attention, Mamba and short conv are counted from the code, under the same margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twinkle_server.engine.errors import InvalidArgument

ATTENTION, LINEAR_ATTENTION, MAMBA = "attention", "linear_attention", "mamba"
SHORT_CONV = "conv"
"""LFM2's `layer_types` entry for its gated short-convolution mixer."""
DENSE, MOE = "mlp", "moe"
_ATTENTION_TYPES = ("full_attention", "sliding_attention", "attention", "chunked_attention")
_RECURRENT_TYPES = ("linear_attention", "mamba")
LINEAR_SCAN_CHUNK = 64
"""Gated DeltaNet's chunk size in transformers' torch kernel (`chunk_gated_delta_rule`)."""
MAMBA_SCAN_CHUNK = 128
"""Mamba2's default chunk size (`chunk_size` in its configs)."""


@dataclass(frozen=True)
class LayerKind:
    """One decoder layer: its token mixer and its MLP (None: the layer has none)."""

    mixer: str | None
    mlp: str | None


def text_config(config: Any) -> Any:
    """The language model's config (a multimodal config's text part)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _size(config: Any, *names: str) -> int | None:
    """The first of `names` the config sets to a positive number."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _need(config: Any, kind: str, *names: str) -> int:
    value = _size(config, *names)
    if value is None:
        raise InvalidArgument(
            f"model: its config has {kind} layers but none of {list(names)}; the memory "
            f"estimate cannot size them and does not guess")
    return value


def layer_kinds(config: Any) -> list[LayerKind]:
    """Every decoder layer's kind, from `layer_types` / `layers_block_type` and the MoE
    placement fields (`mlp_only_layers`, `first_k_dense_replace`, `decoder_sparse_step`)."""
    text = text_config(config)
    count = int(text.num_hidden_layers)
    types = list(getattr(text, "layers_block_type", None) or getattr(text, "layer_types", None)
                 or ["full_attention"] * count)
    if len(types) != count:
        raise InvalidArgument(f"model: layer_types has {len(types)} entries for {count} "
                              "layers (num_hidden_layers); the memory estimate reads each "
                              "layer's kind from it")
    blocks = any(t in (DENSE, MOE) for t in types)   # Nemotron-H: one part a layer
    recurrent = MAMBA if _size(text, "mamba_num_heads") else LINEAR_ATTENTION
    kinds = []
    for index, kind in enumerate(types):
        if kind in _ATTENTION_TYPES:
            mixer: str | None = ATTENTION
        elif kind in _RECURRENT_TYPES:
            mixer = recurrent if kind == "linear_attention" else MAMBA
        elif kind == SHORT_CONV:
            mixer = SHORT_CONV
        elif blocks and kind in (DENSE, MOE):
            kinds.append(LayerKind(None, kind))
            continue
        else:
            raise InvalidArgument(f"model: layer {index} is of kind {kind!r}, which the "
                                  "memory estimate does not size")
        kinds.append(LayerKind(mixer, None if blocks else _mlp_kind(text, index)))
    return kinds


def _mlp_kind(text: Any, index: int) -> str:
    """Dense or MoE for layer `index` of a model whose layers have both parts."""
    if not _size(text, "num_experts", "num_local_experts", "n_routed_experts"):
        return DENSE
    if index in (getattr(text, "mlp_only_layers", None) or []):
        return DENSE
    if index < (getattr(text, "first_k_dense_replace", None) or 0):
        return DENSE
    step = getattr(text, "decoder_sparse_step", None) or 1
    return MOE if (index + 1) % step == 0 else DENSE


def part_elements(config: Any, part: str) -> tuple[int, int]:
    """(elements in the model dtype, float32 elements) one part of a layer keeps per token
    (module docstring)."""
    text = text_config(config)
    hidden = int(text.hidden_size)
    if part == ATTENTION:
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
        q_width = heads * head_dim
        kv_width = int(getattr(text, "num_key_value_heads", None) or heads) * head_dim
        return 2 * hidden + 6 * q_width + kv_width, 4 * hidden + 2 * q_width + kv_width
    if part == DENSE:
        inter = _need(text, "dense MLP", "intermediate_size")
        return 2 * hidden + 4 * inter, 3 * hidden + inter
    if part == MOE:
        return _moe_elements(text, hidden)
    if part == LINEAR_ATTENTION:
        heads = _need(text, "linear attention", "linear_num_value_heads")
        keys = _need(text, "linear attention", "linear_num_key_heads") * _need(
            text, "linear attention", "linear_key_head_dim")
        values = heads * _need(text, "linear attention", "linear_value_head_dim")
        return (2 * hidden + 8 * keys + 8 * values + (2 + LINEAR_SCAN_CHUNK) * heads,
                5 * hidden + values)
    if part == MAMBA:
        heads = _need(text, "Mamba", "mamba_num_heads")
        inner = heads * _need(text, "Mamba", "mamba_head_dim")
        groups_state = _need(text, "Mamba", "n_groups", "mamba_n_groups") * _need(
            text, "Mamba", "ssm_state_size")
        chunk = _size(text, "chunk_size") or MAMBA_SCAN_CHUNK
        return (2 * hidden + 9 * inner + 6 * groups_state + (1 + chunk) * heads,
                2 * hidden + inner)
    if part == SHORT_CONV:
        return 8 * hidden, 2 * hidden
    raise InvalidArgument(f"model: a layer part of kind {part!r}, which the memory "
                          "estimate does not size")


def _moe_elements(text: Any, hidden: int) -> tuple[int, int]:
    """An MoE block's count: `num_experts_per_tok` routed experts a token, each
    `moe_intermediate_size` wide (gpt-oss: `intermediate_size`), plus shared experts."""
    experts = _need(text, "MoE", "num_experts", "num_local_experts", "n_routed_experts")
    active = _need(text, "MoE", "num_experts_per_tok", "num_experts_per_token")
    width = _need(text, "MoE", "moe_intermediate_size", "intermediate_size")
    shared = _size(text, "shared_expert_intermediate_size",
                   "moe_shared_expert_intermediate_size")
    if shared is None and _size(text, "n_shared_experts"):
        shared = int(text.n_shared_experts) * width
    shared = shared or 0
    kept = 2 * hidden + active * hidden + 4 * (active * width + shared) + 2 * experts
    upcast = (hidden + 2 * active * hidden + active * width
              + (2 * hidden + shared if shared else 0))
    return kept, upcast


def layer_elements(config: Any) -> list[tuple[int, int]]:
    """(model-dtype elements, float32 elements) each decoder layer keeps per token."""
    out = []
    for kind in layer_kinds(config):
        parts = [part_elements(config, p) for p in (kind.mixer, kind.mlp) if p is not None]
        out.append((sum(k for k, _ in parts), sum(u for _, u in parts)))
    return out


def kv_elements_per_token(config: Any) -> int:
    """Elements one position holds in a decode cache: keys and values (2 x the key/value
    width) of every attention layer. Recurrent mixers hold a state of fixed size instead
    (`state_elements_per_row`)."""
    text = text_config(config)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads)
    kv_width = int(getattr(text, "num_key_value_heads", None) or heads) * head_dim
    return sum(2 * kv_width for kind in layer_kinds(config) if kind.mixer == ATTENTION)


def state_elements_per_row(config: Any) -> int:
    """Elements a decoding row's recurrent mixers hold whatever its length: each causal
    conv's last `kernel` inputs, and each scan's state (Gated DeltaNet: value heads x key
    head dim x value head dim; Mamba2: heads x head dim x state size; LFM2's short conv
    has its conv only)."""
    return sum(_state_elements(config, kind.mixer) for kind in layer_kinds(config)
               if kind.mixer in (LINEAR_ATTENTION, MAMBA, SHORT_CONV))


def _state_elements(config: Any, mixer: str) -> int:
    text = text_config(config)
    if mixer == LINEAR_ATTENTION:
        heads = _need(text, "linear attention", "linear_num_value_heads")
        key_dim = _need(text, "linear attention", "linear_key_head_dim")
        value_dim = _need(text, "linear attention", "linear_value_head_dim")
        keys = _need(text, "linear attention", "linear_num_key_heads") * key_dim
        kernel = _need(text, "linear attention", "linear_conv_kernel_dim")
        return (2 * keys + heads * value_dim) * kernel + heads * key_dim * value_dim
    if mixer == MAMBA:
        heads = _need(text, "Mamba", "mamba_num_heads")
        inner = heads * _need(text, "Mamba", "mamba_head_dim")
        state = _need(text, "Mamba", "ssm_state_size")
        groups_state = _need(text, "Mamba", "n_groups", "mamba_n_groups") * state
        kernel = _need(text, "Mamba", "conv_kernel", "mamba_d_conv")
        return (inner + 2 * groups_state) * kernel + inner * state
    return int(text.hidden_size) * _need(text, "short convolution", "conv_L_cache")
