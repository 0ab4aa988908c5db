"""The memory estimate reads sizes per layer kind (`engine.layer_kinds`): every family's
config gives a positive, sane per-token bound; a kind or size it cannot read is refused by
name, never guessed."""

from __future__ import annotations

import pytest
import torch
from transformers import PretrainedConfig

from twinkle_server.engine import memory
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.layer_kinds import (
    ATTENTION,
    DENSE,
    LINEAR_ATTENTION,
    MAMBA,
    MOE,
    LayerKind,
    kv_elements_per_token,
    layer_kinds,
    state_elements_per_row,
)
from twinkle_server.engine.sampling.cache_layers import state_layers

from .families import FAMILIES, family_config

VOCAB = 256


def _config(family: str, **overrides):
    config = family_config(family, VOCAB, **overrides)
    if family == "qwen3_5_moe_text":
        # The real Qwen3.5-MoE / Qwen3.6 config has no intermediate_size (the tiny
        # families' shared settings give every config one).
        del config.intermediate_size
        assert not hasattr(config, "intermediate_size")
    return config


KINDS = {
    "llama": [LayerKind(ATTENTION, DENSE)] * 2,
    "qwen3_moe": [LayerKind(ATTENTION, DENSE), LayerKind(ATTENTION, MOE)],
    "glm4_moe": [LayerKind(ATTENTION, DENSE), LayerKind(ATTENTION, MOE)],
    "gpt_oss": [LayerKind(ATTENTION, MOE)] * 2,
    "qwen3_5_text": [LayerKind(LINEAR_ATTENTION, DENSE)] * 3 + [LayerKind(ATTENTION, DENSE)],
    "qwen3_5_moe_text": [LayerKind(LINEAR_ATTENTION, MOE)] * 3 + [LayerKind(ATTENTION, MOE)],
    "qwen3_next": [LayerKind(LINEAR_ATTENTION, MOE)] * 3 + [LayerKind(ATTENTION, MOE)],
    "nemotron_h": [LayerKind(MAMBA, None), LayerKind(ATTENTION, None), LayerKind(None, DENSE),
                   LayerKind(None, MOE)],
}


@pytest.mark.parametrize("family", sorted(KINDS))
def test_each_layer_has_its_kind(family):
    assert layer_kinds(_config(family)) == KINDS[family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gives_a_positive_sane_bound(family):
    config = _config(family)
    hidden = config.hidden_size
    for kept, upcast in memory.layer_elements(config):
        # At least a norm's input and output; at most what 64 hidden-wide tensors hold
        # (the widest part here, linear attention, keeps about 18 H at these sizes).
        assert 2 * hidden < kept < 64 * hidden and hidden <= upcast < 64 * hidden
    for dtype in (torch.float32, torch.bfloat16):
        full = memory.activation_bytes_per_token(config, dtype)
        assert 0 < memory.activation_bytes_per_token(config, dtype, True) <= full
    assert memory.pass_headroom_bytes(config, torch.bfloat16, VOCAB, 4096) > 0


def test_moe_layers_count_the_experts_a_token_goes_to():
    one, two = (memory.layer_elements(_config("qwen3_moe", num_experts_per_tok=k))[1][0]
                for k in (1, 2))
    shared = memory.layer_elements(_config("qwen3_5_moe_text"))[3][0]
    unshared = memory.layer_elements(_config("qwen3_5_moe_text",
                                             shared_expert_intermediate_size=0))[3][0]
    # One expert more: its input (H) and its four width-32 activations.
    assert two - one == 64 + 4 * 32
    assert shared - unshared == 4 * 32


def test_a_kind_or_size_it_cannot_read_is_refused_by_name():
    config = _config("qwen3_5_text")
    config.layer_types = ["linear_attention", "cross_attention", "linear_attention",
                          "full_attention"]
    with pytest.raises(InvalidArgument, match="layer 1 is of kind 'cross_attention'"):
        memory.activation_bytes_per_token(config, torch.float32)
    # A config of an unknown model: its fields alone, no width for the MLP it has.
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(InvalidArgument, match=r"MoE layers but none of "
                                              r"\['moe_intermediate_size'"):
        memory.activation_bytes_per_token(
            PretrainedConfig(**shape, num_experts=4, num_experts_per_tok=2), torch.float32)
    with pytest.raises(InvalidArgument, match=r"dense MLP layers but none of "
                                              r"\['intermediate_size'\]"):
        memory.activation_bytes_per_token(PretrainedConfig(**shape), torch.float32)
    config = _config("qwen3")
    config.num_hidden_layers = 3
    with pytest.raises(InvalidArgument, match="layer_types has 2 entries for 3 layers"):
        memory.activation_bytes_per_token(config, torch.float32)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_cache_sizes_equal_what_transformers_holds(family):
    """Per position, the attention layers' keys and values; per row, the recurrent
    mixers' conv and scan states (what the decode pool counts: `memory.kv_bytes_per_token`,
    `memory.state_bytes_per_row`), against the cache transformers fills in a prefill."""
    from transformers import AutoModelForCausalLM, DynamicCache

    config = family_config(family, 300, pad_token_id=0)
    if state_elements_per_row(config) and not state_layers(config):
        pytest.skip(f"this transformers keeps {family}'s states in a cache of the model's "
                    "own, not in DynamicCache")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    cache = DynamicCache(config=config)
    tokens = 6
    with torch.no_grad():
        model(input_ids=torch.arange(1, tokens + 1)[None], past_key_values=cache,
              use_cache=True)
    kv, state = 0, 0
    for layer in cache.layers:
        for states in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
            state += sum(t.numel() for t in states.values() if t is not None)
        keys = getattr(layer, "keys", None)     # a window (16 here) holds all 6 tokens
        if isinstance(keys, torch.Tensor) and keys.numel():
            kv += (keys.numel() + layer.values.numel()) // tokens
    assert (kv, state) == (kv_elements_per_token(config), state_elements_per_row(config))
