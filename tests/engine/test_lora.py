"""The multi-LoRA layer against the formula, row routing, init, dropout and PEFT targeting.

These use a toy two-layer module and a freshly built micro Qwen3 (no tiny-model cache),
so they run in well under a second each.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.lora import LoraWeights, Router, inject, resolve_targets
from twinkle_server.engine.types import LoraSpec

IN, OUT = 12, 10


def _eighths(*shape: int, top: int = 8) -> torch.Tensor:
    """Multiples of 1/8 in [-top/8, top/8]: their products and sums are exact in float32."""
    return torch.randint(-top, top + 1, shape).float() / 8


def _layer(seed: int = 0):
    """A routed linear layer whose base projection is exact: weights and bias in eighths of
    at most 1/4 (inputs from `_eighths` at most 1), so every partial sum of a row is a
    multiple of 1/64 under 4 and the base gives the same bits whatever GEMM kernel BLAS
    picks for the batch's row count. What differs merged and alone is then only the
    routing's own arithmetic."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, OUT))
    with torch.no_grad():
        model[0].weight.copy_(_eighths(OUT, IN, top=2))
        model[0].bias.copy_(_eighths(OUT, top=2))
    router = Router()
    layers = inject(model, router)
    return model, router, layers["0"]


def _weights(spec: LoraSpec, seed: int) -> LoraWeights:
    w = LoraWeights(IN, OUT, spec, torch.Generator().manual_seed(seed))
    with torch.no_grad():  # B starts at zero; give it values so the delta is visible
        w.lora_B.copy_(torch.randn(w.lora_B.shape, generator=torch.Generator().manual_seed(99)))
    return w


def _by_hand(layer, w: LoraWeights, x: torch.Tensor) -> torch.Tensor:
    return layer.base_layer(x) + w.scaling * (x @ w.lora_A.T @ w.lora_B.T)


def test_single_adapter_batch_equals_base_plus_scaled_b_a_x():
    _, router, layer = _layer()
    spec = LoraSpec(rank=4, alpha=8)
    layer.adapters["a"] = w = _weights(spec, 1)
    x = torch.randn(3, 5, IN)
    with router.route(["a", "a", "a"]):
        got = layer(x)
    assert w.scaling == 2.0
    torch.testing.assert_close(got, _by_hand(layer, w, x), rtol=0, atol=1e-6)


def test_rslora_scales_by_alpha_over_sqrt_rank():
    assert LoraSpec(rank=16, alpha=8, use_rslora=True).scaling == 2.0
    assert LoraSpec(rank=16, alpha=8).scaling == 0.5


def test_mixed_batch_gives_each_row_its_own_adapter_and_base_rows_the_base():
    _, router, layer = _layer()
    wa, wb = _weights(LoraSpec(rank=2, alpha=2), 1), _weights(LoraSpec(rank=6, alpha=3), 2)
    layer.adapters.update(a=wa, b=wb)
    x = _eighths(5, 4, IN)
    with router.route(["a", "a", None, "b", "b"]):
        got = layer(x)
    torch.testing.assert_close(got[:2], _by_hand(layer, wa, x[:2]), rtol=0, atol=1e-6)
    # The base only, exactly: the base over 1 row is the base over 5 (see `_layer`).
    torch.testing.assert_close(got[2], layer.base_layer(x[2]), rtol=0, atol=0)
    torch.testing.assert_close(got[3:], _by_hand(layer, wb, x[3:]), rtol=0, atol=1e-6)


def test_adapter_gradient_from_a_mixed_batch_equals_its_gradient_alone():
    _, router, layer = _layer()
    wa, wb = _weights(LoraSpec(rank=2, alpha=2), 1), _weights(LoraSpec(rank=3, alpha=3), 2)
    layer.adapters.update(a=wa, b=wb)
    x = _eighths(4, 3, IN)
    with router.route(["b", "a", "a", None]):
        layer(x)[1:3].pow(2).sum().backward()
    merged = [p.grad.clone() for p in (wa.lora_A, wa.lora_B)]
    # b's rows are outside the loss: every term of its gradient is 0 * finite, exactly 0.
    assert float(wb.lora_A.grad.abs().max()) == 0.0 and float(wb.lora_B.grad.abs().max()) == 0.0
    wa.zero_grad()
    with router.route(["a", "a"]):
        layer(x[1:3]).pow(2).sum().backward()
    for got, want in zip(merged, (wa.lora_A.grad, wa.lora_B.grad), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("route", [list("aabbcc"), list("abbbcc"), ["a", None, "b", "c"]])
def test_rows_are_bit_for_bit_the_same_merged_as_alone_outputs_and_gradients(route):
    # Exact, not a rounding apart: the base is exact (see `_layer`), and each adapter's
    # delta and its gradient are the same matmuls on the same rows as alone. 8 positions
    # put every row's slice of x and of the gradient 64-byte aligned (8 * 12 and 8 * 10
    # floats), as alone: MKL's results may depend on alignment.
    _, router, layer = _layer()
    weights = {name: _weights(LoraSpec(rank=r, alpha=a), i)
               for i, (name, r, a) in enumerate([("a", 3, 3), ("b", 3, 12), ("c", 5, 1)])}
    layer.adapters.update(weights)
    x = _eighths(len(route), 8, IN)
    grad = torch.randn(len(route), 8, OUT)
    with router.route(route):
        merged = layer(x)
        (merged * grad).sum().backward()
    merged_grads = {n: (w.lora_A.grad.clone(), w.lora_B.grad.clone()) for n, w in weights.items()}
    for name, w in weights.items():
        rows = [i for i, r in enumerate(route) if r == name]
        w.zero_grad()
        with router.route([name] * len(rows)):
            alone = layer(x[rows])
            (alone * grad[rows]).sum().backward()
        assert torch.equal(merged[rows], alone)
        assert torch.equal(merged_grads[name][0], w.lora_A.grad)
        assert torch.equal(merged_grads[name][1], w.lora_B.grad)


@pytest.mark.parametrize("axis", ["rows", "tokens"])
def test_without_autograd_deltas_are_added_in_place_as_the_autograd_path_adds_them(axis):
    """Sampling and scoring add each segment's delta into the base output in place; the
    result is the autograd path's within float32 rounding (scaled before or after B:
    1e-6 on these magnitudes), segments without an adapter keep the base exactly."""
    _, router, layer = _layer()
    layer.adapters.update({"a": _weights(LoraSpec(rank=3, alpha=5), 1),
                           "b": _weights(LoraSpec(rank=2, alpha=2), 2)})
    route = ["a", "a", None, "b"]
    x = torch.randn(4, 3, IN)
    if axis == "rows":
        routed, given = router.route(route), x
    else:
        routed, given = router.route_tokens([3, 3, 3, 3], route), x.reshape(1, 12, IN)
    with routed:
        graded = layer(given)
        with torch.inference_mode():
            in_place = layer(given)
    torch.testing.assert_close(in_place, graded.detach(), rtol=0, atol=1e-6)
    base = layer.base_layer(given).detach()
    rows = slice(2, 3) if axis == "rows" else (slice(None), slice(6, 9))
    assert torch.equal(in_place[rows], base[rows])


def test_rows_outside_any_route_or_of_untargeting_adapters_get_the_base_only():
    _, router, layer = _layer()
    layer.adapters["a"] = _weights(LoraSpec(rank=2, alpha=2), 1)
    x = torch.randn(2, 3, IN)
    torch.testing.assert_close(layer(x), layer.base_layer(x), rtol=0, atol=0)
    with router.route(["other", "other"]):
        torch.testing.assert_close(layer(x), layer.base_layer(x), rtol=0, atol=0)


def test_router_refuses_split_rows_of_one_adapter():
    router = Router()
    with pytest.raises(ValueError, match="rows of adapter 'a' are not contiguous"):
        with router.route(["a", "b", "a"]):
            pass
    with router.route(["a", "a"], [True, False]):  # same adapter, train then eval rows
        assert [(s.start, s.end, s.train) for s in router.segments] == [(0, 1, True),
                                                                        (1, 2, False)]
    assert router.segments == ()


def test_same_seed_gives_the_same_init_and_b_starts_at_zero_like_peft():
    spec = LoraSpec(rank=8, alpha=16)
    one = LoraWeights(64, 32, spec, torch.Generator().manual_seed(5))
    two = LoraWeights(64, 32, spec, torch.Generator().manual_seed(5))
    other = LoraWeights(64, 32, spec, torch.Generator().manual_seed(6))
    assert torch.equal(one.lora_A, two.lora_A) and not torch.equal(one.lora_A, other.lora_A)
    assert one.lora_A.dtype == torch.float32 and float(one.lora_B.detach().abs().max()) == 0.0
    # PEFT's kaiming_uniform(a=sqrt(5)) draws from U(-1/sqrt(in), 1/sqrt(in)): compare the
    # support and the spread with PEFT's own layer of the same shape.
    peft_layer = get_peft_model(nn.Sequential(nn.Linear(64, 32)),
                                LoraConfig(r=8, lora_alpha=16, target_modules=["0"]))
    peft_a = next(m for m in peft_layer.modules() if isinstance(m, LoraLayer)
                  ).lora_A["default"].weight
    bound = 1 / 64 ** 0.5
    ours, theirs = one.lora_A.detach(), peft_a.detach()
    assert float(ours.abs().max()) <= bound and float(theirs.abs().max()) <= bound
    assert abs(float(ours.std()) - float(theirs.std())) < 0.1 * bound


def test_dropout_applies_on_training_rows_only():
    _, router, layer = _layer()
    layer.adapters["a"] = w = _weights(LoraSpec(rank=4, alpha=4, dropout=0.5), 1)
    x = _eighths(2, 6, IN)  # row 1 alone below: an exact base (see `_layer`)
    with router.route(["a", "a"]):
        torch.testing.assert_close(layer(x), _by_hand(layer, w, x), rtol=0, atol=1e-6)
    torch.manual_seed(0)
    with router.route(["a", "a"], [True, False]):
        got = layer(x)
    assert not torch.allclose(got[0], _by_hand(layer, w, x[:1])[0], atol=1e-4)
    torch.testing.assert_close(got[1], _by_hand(layer, w, x[1:])[0], rtol=0, atol=1e-6)


def _micro_qwen() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, max_position_embeddings=32, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config)


@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "v_proj"), ("lm_head",),
                                     r".*\.mlp\.(up|down)_proj", ("layers.1.self_attn.o_proj",)])
def test_target_resolution_matches_what_peft_wraps(targets):
    model = _micro_qwen()
    output = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    ours = resolve_targets(inject(model, Router()), LoraSpec(rank=2, alpha=2,
                                                             target_modules=targets), output)
    peft_targets = targets if isinstance(targets, str) else list(targets)
    wrapped = get_peft_model(_micro_qwen(), LoraConfig(r=2, target_modules=peft_targets))
    theirs = sorted(n.removeprefix("base_model.model.") for n, m in wrapped.named_modules()
                    if isinstance(m, LoraLayer))
    assert ours == theirs and ours


def test_a_pattern_matching_nothing_names_itself_and_the_available_modules():
    model = _micro_qwen()
    layers = inject(model, Router())
    with pytest.raises(InvalidArgument, match=r"'qproj' matches no linear layer.*'q_proj'.*"
                                              r"e\.g\. \['lm_head'"):
        resolve_targets(layers, LoraSpec(rank=2, alpha=2, target_modules=("q_proj", "qproj")),
                        "lm_head")
    with pytest.raises(InvalidArgument, match="is empty"):
        resolve_targets(layers, LoraSpec(rank=2, alpha=2, target_modules=()), "lm_head")
