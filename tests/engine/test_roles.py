"""Tinker's switches by role (`engine.roles`) on every family's structure: what attention,
MLP and unembed select, that routers never train, and that a spec selecting nothing is
refused by name. Structure only: random tiny models from the families' config classes,
no engine."""

from __future__ import annotations

import pytest
import torch
import transformers

from twinkle_server.engine import recurrent
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.lora import resolve_targets
from twinkle_server.engine.roles import ROUTER, describe, layer_roles
from twinkle_server.engine.types import ROLE_ATTENTION, ROLE_MLP, ROLE_UNEMBED, LoraSpec

from .families import family_config

# family -> (leaves attention selects, leaves mlp selects, router leaves never trained)
EXPECTED: dict[str, tuple[set[str], set[str], set[str]]] = {
    "llama": ({"q_proj", "k_proj", "v_proj", "o_proj"}, {"gate_proj", "up_proj", "down_proj"},
              set()),
    "phi3": ({"qkv_proj", "o_proj"}, {"gate_up_proj", "down_proj"}, set()),
    "qwen3_moe": ({"q_proj", "k_proj", "v_proj", "o_proj"},
                  {"gate_proj", "up_proj", "down_proj"}, set()),
    "qwen3_next": ({"in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "k_proj", "v_proj",
                    "o_proj"}, {"gate_proj", "up_proj", "down_proj"}, {"shared_expert_gate"}),
    "qwen3_5_text": ({"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
                      "q_proj", "k_proj", "v_proj", "o_proj"},
                     {"gate_proj", "up_proj", "down_proj"}, set()),
    "qwen3_5_moe_text": ({"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
                          "q_proj", "k_proj", "v_proj", "o_proj"},
                         {"gate_proj", "up_proj", "down_proj"}, {"shared_expert_gate"}),
    "gpt_oss": ({"q_proj", "k_proj", "v_proj", "o_proj"}, set(), set()),
    "glm4_moe": ({"q_proj", "k_proj", "v_proj", "o_proj"},
                 {"gate_proj", "up_proj", "down_proj"}, set()),
    "nemotron_h": ({"in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj"},
                   {"up_proj", "down_proj"}, set()),
    # LFM2: attention (its `out_proj`) and the gated short convolution's projections.
    "lfm2": ({"q_proj", "k_proj", "v_proj", "out_proj", "in_proj"}, {"w1", "w2", "w3"}, set()),
    "gemma3_text": ({"q_proj", "k_proj", "v_proj", "o_proj"},
                    {"gate_proj", "up_proj", "down_proj"}, set()),
}


def _linears(family: str) -> tuple[torch.nn.Module, list[str], str]:
    config = family_config(family, 256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config)
    names = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    return model, names, head


def _leaves(names) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n in names}


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_each_switch_selects_its_role_and_routers_never_train(family):
    model, names, head = _linears(family)
    roles = layer_roles(model, names, head)
    attention, mlp, routers = EXPECTED[family]
    assert _leaves(n for n, r in roles.items() if r == ROLE_ATTENTION) == attention
    assert _leaves(n for n, r in roles.items() if r == ROLE_MLP) == mlp
    assert _leaves(n for n, r in roles.items() if r == ROUTER) == routers
    assert [n for n, r in roles.items() if r == ROLE_UNEMBED] == [head]
    assert all(r is not None for r in roles.values()), roles
    chosen = resolve_targets(names, LoraSpec.from_tinker(8), head, roles)
    assert set(chosen) == {n for n, r in roles.items() if r not in (ROUTER, None)}
    # Every linear of the mixers: no attention projection of any layer is left out.
    assert sum(1 for n in chosen if n.rsplit(".", 1)[-1] == "o_proj") == sum(
        1 for n in names if n.endswith("o_proj"))


def test_a_role_the_model_lacks_is_no_error_beside_another():
    model, names, head = _linears("gpt_oss")   # its MLP is experts: no linear
    roles = layer_roles(model, names, head)
    chosen = resolve_targets(names, LoraSpec.from_tinker(4, train_unembed=False), head, roles)
    assert _leaves(chosen) == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_switches_that_select_nothing_are_refused_by_name():
    model, names, head = _linears("gpt_oss")
    roles = layer_roles(model, names, head)
    spec = LoraSpec.from_tinker(4, train_attn=False, train_unembed=False)
    with pytest.raises(InvalidArgument, match=r"train_mlp select no linear layer.*mlp 0.*"
                                              r"routers are never trained.*train nothing"):
        resolve_targets(names, spec, head, roles)


def test_explicit_peft_target_modules_work_as_before():
    model, names, head = _linears("phi3")
    roles = layer_roles(model, names, head)
    spec = LoraSpec(rank=4, alpha=8, target_modules=("qkv_proj",))
    assert _leaves(resolve_targets(names, spec, head, roles)) == {"qkv_proj"}
    with pytest.raises(InvalidArgument, match="'q_proj' matches no linear layer"):
        resolve_targets(names, LoraSpec(rank=4, alpha=8, target_modules=("q_proj",)), head,
                        roles)



def test_the_log_counts_what_the_switches_train_not_what_peft_refuses():
    model, names, head = _linears("nemotron_h")
    layer_roles_ = layer_roles(model, {n: model.get_submodule(n) for n in names}, head)
    refused = recurrent.peft_refused(model, names)
    if not refused:
        pytest.skip("this peft has no rule against LoRA on Mamba's out_proj")
    mamba_out = {n for n in names if n.endswith("mixer.out_proj")}
    assert mamba_out and mamba_out <= refused
    attention = [n for n, r in layer_roles_.items() if r == ROLE_ATTENTION]
    text = describe(layer_roles_, refused)
    assert f"attention {len(attention) - len(refused)}," in text, text
    assert f"left out, PEFT refuses LoRA on them: out_proj ({len(refused)})" in text, text
    assert "left out" not in describe(layer_roles_)
