"""Every dense family Tinker users train, with Tinker's default LoRA (attention, MLP and
unembed, `LoraSpec.from_tinker`): the loss falls, the export loads in `peft` with the
engine's logprobs, merged equals alone, packed equals separate passes.

Each family is a tiny random model from its own transformers config class
(`tests/engine/families.py`). The engine and `peft` compute the same LoRA by different
code, and merged or packed passes run GEMMs of other shapes than alone: they agree to the
isolation contract's LOGPROB_ATOL (`tests/numerics.py`). glm4_moe is here for its dense
MLP, shared experts and attention beside its routed experts, which `train_mlp` trains too
(`engine.experts`; every MoE family: tests/engine/test_experts.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from twinkle_server.engine.adapter_import import base_linears, read_import
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import AdamParams, Datum, EngineLimits, LoraSpec, LossSpec

from ..numerics import LOGPROB_ATOL, assert_trained_alike
from .conftest import adapter_weights
from .families import (
    SOFT_CAPPED,
    next_token_datums,
    peft_logprobs,
    random_datums,
    randomize_b,
    skip_unserved_experts,
    write_family,
)

CE = LossSpec("cross_entropy")
DENSE = ["llama", "qwen2", "qwen3", "olmo2", "granite", "smollm3", "phi3", "glm4_moe"]
SLIDING = ["mistral", "gemma3_text", "gemma2"]
"""Sliding-window families (their decode pool holds the window: tests/engine/sampling/
test_pool_layer_kinds.py)."""
LOOP = ("phi3", "glm4_moe")
"""Families whose LoRA sits elsewhere than Llama's (fused linears; shared experts, dense
MLP beside routed experts): trained against a plain peft loop too."""
TEXTS = ["Hello! I am Twinkle, a helpful assistant.",
         "Question: 12 + 30 = ? Answer: 42. #### 42",
         "You can call me Twinkle."]
STEPS = 4
ADAM = AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module", params=DENSE + SLIDING)
def family(request, tiny_cache, tmp_path_factory) -> tuple[str, Engine]:
    name = request.param
    path = write_family(tmp_path_factory.mktemp("families"), name, tiny_cache)
    engine = Engine.load(str(path), cache_dir=str(tiny_cache),
                         limits=EngineLimits(max_adapters=4, max_rank=16, max_seq_len=64,
                                             max_batch_tokens=1024, kv_pool_tokens=256))
    return name, skip_unserved_experts(engine)


def _datums(engine: Engine) -> list[Datum]:
    """Next-token datums of different lengths from fixed sentences."""
    return next_token_datums(engine, TEXTS)


@pytest.fixture(scope="module")
def trained(family) -> tuple[str, Engine, list[float]]:
    """Tinker's default adapter (rank 8) trained `STEPS` steps on one sentence; the
    losses of its steps."""
    name, engine = family
    engine.add_adapter("default", LoraSpec.from_tinker(8, seed=1))
    task = _datums(engine)[:1]
    losses = []
    for _ in range(STEPS):
        out = engine.forward_batch([ForwardRequest("default", task, CE, True)])[0]
        engine.optim_step("default", ADAM)
        losses.append(out.loss)
    return name, engine, losses


def _logprobs(engine: Engine, requests: list[ForwardRequest]) -> list[list[np.ndarray]]:
    return [out.logprobs for out in engine.forward_batch(requests)]


def test_default_tinker_lora_trains_and_the_loss_falls(trained):
    name, engine, losses = trained
    trains = {n.rsplit(".", 1)[-1] for n in engine.adapters["default"].weights}
    assert "lm_head" in trains and trains & {"q_proj", "qkv_proj"}, (name, trains)
    assert trains & {"up_proj", "gate_up_proj"}, (name, trains)
    # Each step lowers the loss, by 5% over the four at least: far beyond rounding (1e-5).
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.95 * losses[0], f"{name}: losses {losses}"


def test_the_export_loads_in_peft_with_the_engines_logprobs(trained, tmp_path):
    name, engine, _ = trained
    datums = _datums(engine)
    ours = _logprobs(engine, [ForwardRequest("default", datums, CE, False)])[0]
    engine.save_weights("default", tmp_path / "export")
    base = AutoModelForCausalLM.from_pretrained(engine.base.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path / "export")).eval()
    for datum, got in zip(datums, ours, strict=True):
        np.testing.assert_allclose(got, peft_logprobs(model, datum), rtol=0,
                                   atol=LOGPROB_ATOL, err_msg=name)


def test_two_adapters_merged_in_one_pass_equal_each_alone(trained):
    name, engine, _ = trained
    engine.add_adapter("other", LoraSpec.from_tinker(4, seed=2, train_mlp=False))
    try:
        randomize_b(engine, "other", 3, 0.05)
        datums = _datums(engine)
        requests = [ForwardRequest("default", datums[:2], CE, False),
                    ForwardRequest("other", datums[1:], CE, False)]
        merged = _logprobs(engine, requests)
        for request, together in zip(requests, merged, strict=True):
            alone = _logprobs(engine, [request])[0]
            for a, b in zip(alone, together, strict=True):
                np.testing.assert_allclose(b, a, rtol=0, atol=LOGPROB_ATOL, err_msg=name)
    finally:
        engine.remove_adapter("other")


def test_a_packed_pass_equals_each_datum_in_its_own_pass(trained):
    name, engine, _ = trained
    assert engine.packing
    datums = _datums(engine)
    packed = _logprobs(engine, [ForwardRequest("default", datums, CE, False)])[0]
    for datum, got in zip(datums, packed, strict=True):
        alone = _logprobs(engine, [ForwardRequest("default", [datum], CE, False)])[0][0]
        np.testing.assert_allclose(got, alone, rtol=0, atol=LOGPROB_ATOL, err_msg=name)


def test_a_gemma2_whose_attention_soft_cap_bites_has_the_logprobs_of_transformers_and_peft(
        tiny_cache, tmp_path):
    # Gemma 2 passes its cap (`softcap`) to its eager attention, which packed passes
    # replace (`packing.packed_attention`); two datums past its 16-token window, packed.
    path = write_family(tmp_path / "models", "gemma2", tiny_cache, **SOFT_CAPPED)
    engine = Engine.load(str(path), cache_dir=str(tiny_cache),
                         limits=EngineLimits(max_adapters=2, max_rank=16, max_seq_len=64,
                                             max_batch_tokens=1024, kv_pool_tokens=256))
    assert engine.packing
    engine.add_adapter("a", LoraSpec.from_tinker(8, seed=1))
    randomize_b(engine, "a", 3, 0.05)
    datums = random_datums(engine, (30, 21))
    ours = _logprobs(engine, [ForwardRequest("a", datums, CE, False)])[0]
    engine.save_weights("a", tmp_path / "export")
    # Eager, the attention that caps (transformers before 5.x gave Gemma 2 sdpa, which
    # drops the cap, by default).
    base = AutoModelForCausalLM.from_pretrained(engine.base.model_dir, dtype=torch.float32,
                                                attn_implementation="eager")
    model = PeftModel.from_pretrained(base, str(tmp_path / "export")).eval()
    for datum, got in zip(datums, ours, strict=True):
        np.testing.assert_allclose(got, peft_logprobs(model, datum), rtol=0,
                                   atol=LOGPROB_ATOL)
    # The cap bites: the same model without it is far outside the tolerance.
    for module in model.modules():
        if hasattr(module, "attn_logit_softcapping"):
            module.attn_logit_softcapping = None
    assert np.abs(peft_logprobs(model, datums[0]) - ours[0]).max() > 100 * LOGPROB_ATOL


def test_three_adamw_steps_equal_a_plain_peft_loop(family, tmp_path):
    """The engine trains the numbers transformers + peft + torch.optim would, from the
    same first weights (glm4_moe's routed experts included, as peft's parameter
    targets)."""
    name, engine = family
    if name not in LOOP:
        pytest.skip(f"{name} is Llama-shaped: tests/engine/test_parity_peft.py's loop covers it")
    engine.add_adapter("loop", LoraSpec.from_tinker(8, seed=5))
    try:
        engine.save_weights("loop", tmp_path / "init")
        base = AutoModelForCausalLM.from_pretrained(engine.base.model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(tmp_path / "init"), is_trainable=True)
        params = [p for p in model.parameters() if p.requires_grad]
        adam = AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.01)
        opt = torch.optim.AdamW(params, lr=adam.learning_rate, betas=(adam.beta1, adam.beta2),
                                eps=adam.eps, weight_decay=adam.weight_decay)
        batch = _datums(engine)
        for _ in range(3):
            engine.forward_batch([ForwardRequest("loop", batch, CE, True)])
            engine.optim_step("loop", adam)
            loss = sum(-peft_logprobs(model, d, grad=True).sum() for d in batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
        theirs = {k.replace(".default", ""): v for k, v in model.state_dict().items()
                  if "lora_" in k}
        assert_trained_alike(adapter_weights(engine, "loop"), theirs, adam.learning_rate, 3)
    finally:
        engine.remove_adapter("loop")


def test_a_glm4_moe_export_names_its_mlp_linears_as_peft_reads_them(tiny_cache, tmp_path):
    """peft rewrites `gate_proj`/`up_proj`/`down_proj` targets of glm4_moe into its routed
    experts' parameters; the export names the dense MLP and shared experts' linears as
    parameter targets of their weights instead, beside the routed experts' own
    projections, dropout (which peft refuses there) written as 0 in a sampler export and
    kept in a training checkpoint."""
    path = write_family(tmp_path / "models", "glm4_moe", tiny_cache)
    engine = Engine.load(str(path), cache_dir=str(tiny_cache), samples=False,
                         limits=EngineLimits(max_adapters=1, max_rank=8, max_seq_len=64,
                                             max_batch_tokens=512))
    skip_unserved_experts(engine)
    engine.add_adapter("drop", LoraSpec(rank=4, alpha=8, dropout=0.1, seed=1,
                                        target_modules=("role:attention", "role:mlp")))
    datums = _datums(engine)
    engine.forward_batch([ForwardRequest("drop", datums, CE, True)])
    engine.optim_step("drop", ADAM)
    engine.save_weights("drop", tmp_path / "export")
    engine.save_state("drop", tmp_path / "state")
    config = json.loads((tmp_path / "export" / "adapter_config.json").read_text())
    weights = engine.adapters["drop"].weights
    linears = sorted(n for n in weights if n in engine.layers)
    routed = sorted(w.parameter for n, w in weights.items() if n not in engine.layers)
    assert routed, "train_mlp trains the routed experts too"
    assert {t.rsplit(".", 2)[-2] for t in config["target_parameters"]
            if t.endswith(".weight")} == {"gate_proj", "up_proj", "down_proj"}
    assert sorted(t for t in config["target_parameters"] if not t.endswith(".weight")) == routed
    assert not any(t.endswith(("gate_proj", "up_proj", "down_proj"))
                   for t in config["target_modules"])
    assert config["lora_dropout"] == 0.0
    assert engine.read_checkpoint_spec(tmp_path / "state").dropout == 0.1
    # Read back, the export selects exactly the adapter's linears and experts.
    again_spec = engine.read_checkpoint_spec(tmp_path / "export")
    assert engine._targets(again_spec) == linears
    # Imported again as it was exported: every linear and expert projection it trains.
    base = base_linears(path)
    again = read_import(tmp_path / "export", base, max_rank=8, max_bytes=1 << 24)
    assert sorted(again.modules) == linears and list(again.parameters) == routed
    config["target_parameters"].append("model.layers.1.mlp.gate.weight")
    (tmp_path / "export" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidArgument, match=r"target_parameters names "
                                              r"'model.layers.1.mlp.gate.weight'"):
        read_import(tmp_path / "export", base, max_rank=8, max_bytes=1 << 24)
    config["target_parameters"].pop()
    (tmp_path / "export" / "adapter_config.json").write_text(json.dumps(config))
    ours = _logprobs(engine, [ForwardRequest("drop", datums, CE, False)])[0]
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path / "export")).eval()
    for datum, got in zip(datums, ours, strict=True):
        np.testing.assert_allclose(got, peft_logprobs(model, datum), rtol=0,
                                   atol=LOGPROB_ATOL)
