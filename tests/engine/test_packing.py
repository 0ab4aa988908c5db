"""Packed merged passes (`engine.packing`): packed == padded, no attention across datums,
merged == alone with mixed lengths, the router's token segments, and transformers' own
packed-sequence mask checked against ours.

Packed and padded passes, like merged and alone, run GEMMs of different shapes: they
agree to the isolation contract's float32 tolerances (tests/numerics.py, from the
contract at the top of engine.py). Where only a datum's token values change and every
shape stays the same, other datums' numbers must not move at all: exact.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.masking_utils import create_causal_mask

from twinkle_server.config.flags import ServerConfig, add_arguments, from_args
from twinkle_server.engine import packing
from twinkle_server.engine.engine import ForwardRequest
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.lora import ROWS, TOKENS, LoraWeights, MultiLoraLinear, Router
from twinkle_server.engine.packing import PassLayout
from twinkle_server.engine.types import Datum, LoraSpec, LossSpec

from ..numerics import LOGPROB_ATOL, LOSS_RTOL, assert_grads_close
from .families import family_config

CE = LossSpec("cross_entropy")


def _datum(rng: np.random.Generator, n: int, vocab: int, k: int = 0) -> Datum:
    """`n` random next-token positions; `k` > 0 gives `[n, k]` targets (several per
    position), weighted 1."""
    ids = rng.integers(3, vocab, n + 1)
    if k:
        targets = np.stack([ids[1:], *(rng.integers(3, vocab, n) for _ in range(k - 1))], 1)
        return Datum(ids[:-1], {"target_tokens": targets,
                                "weights": np.ones((n, k), np.float32)})
    return Datum(ids[:-1], {"target_tokens": ids[1:], "weights": np.ones(n, np.float32)})


def _add_trained_looking(add, engine, name: str, spec: LoraSpec) -> None:
    """An adapter whose B is not zero (a new adapter's delta is 0), so routing matters;
    drawn from `spec.seed`, so the same spec gives the same adapter."""
    add(name, spec)
    generator = torch.Generator().manual_seed(int(spec.seed or 0))
    with torch.no_grad():
        for weights in engine.adapters[name].weights.values():
            weights.lora_B.copy_(torch.randn(weights.lora_B.shape, generator=generator) * 0.05)


def _run(engine, requests, packed: bool):
    """Results of one pass, and every adapter's gradients from it (by adapter id)."""
    previous, engine.packing = engine.packing, packed
    try:
        for adapter in engine.adapters.values():
            adapter.zero_grad()
        results = engine.forward_batch(requests)
    finally:
        engine.packing = previous
    assert all(not isinstance(r, Exception) for r in results), results
    grads = {name: [None if p.grad is None else p.grad.detach().clone()
                    for p in adapter.parameters()]
             for name, adapter in engine.adapters.items()}
    return results, grads


def _assert_close_results(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.loss == pytest.approx(w.loss, rel=LOSS_RTOL)
        for lg, lw in zip(g.logprobs, w.logprobs, strict=True):
            np.testing.assert_allclose(lg, lw, rtol=0, atol=LOGPROB_ATOL)


def _assert_close_grads(got, want, names) -> None:
    for name in names:
        for g, w in zip(got[name], want[name], strict=True):
            assert g is not None and w is not None, name
            assert_grads_close(g, w)


@pytest.fixture
def three(engine, add):
    """Three adapters of different shapes, B randomised; `b` trains the output layer too,
    so the routing of the output head over packed tokens is exercised."""
    _add_trained_looking(add, engine, "a", LoraSpec(rank=4, alpha=8, seed=1))
    _add_trained_looking(add, engine, "b", LoraSpec.from_tinker(rank=8, seed=2,
                                                                train_unembed=True))
    _add_trained_looking(add, engine, "c", LoraSpec(rank=2, alpha=4, seed=3,
                                                    target_modules=("q_proj", "down_proj")))
    return ["a", "b", "c"]


def test_packed_pass_equals_padded_losses_logprobs_and_gradients(engine, three):
    rng = np.random.default_rng(0)
    vocab = engine.base.vocab_size
    # Mixed lengths (1 to 90 tokens; two of 37 in a row run as one batched attention
    # call), forward-only and backward requests mixed, `b` with
    # both in one pass, one datum with [T, K] targets (it runs outside the fused loss).
    requests = [
        ForwardRequest("a", [_datum(rng, n, vocab) for n in (1, 37, 37, 90)], CE, True),
        ForwardRequest("b", [_datum(rng, n, vocab) for n in (5, 64)], CE, False),
        ForwardRequest("c", [_datum(rng, 20, vocab, k=3), _datum(rng, 50, vocab)], CE, True),
        ForwardRequest("b", [_datum(rng, 12, vocab)], CE, True),
    ]
    packed, packed_grads = _run(engine, requests, packed=True)
    padded, padded_grads = _run(engine, requests, packed=False)
    _assert_close_results(packed, padded)
    _assert_close_grads(packed_grads, padded_grads, three)


def _other_outputs_after_changing_one_datum(engine, new_length: int):
    """Run x (forward), y (forward), z (backward) in one packed pass, then again with y's
    datum (between the others) replaced by `new_length` other tokens; returns the
    largest change of x's and z's logprobs, losses and gradients, and of y's logprobs."""
    rng = np.random.default_rng(1)
    vocab = engine.base.vocab_size
    x, z = [_datum(rng, 30, vocab)], [_datum(rng, 45, vocab), _datum(rng, 8, vocab)]
    y, y2 = _datum(rng, 40, vocab), _datum(rng, new_length, vocab)

    def one(datum):
        return _run(engine, [ForwardRequest("x", x, CE, False),
                             ForwardRequest("y", [datum], CE, False),
                             ForwardRequest("z", z, CE, True)], packed=True)

    (rx, ry, rz), grads = one(y)
    (sx, sy, sz), grads2 = one(y2)
    others = max([abs(rx.loss - sx.loss), abs(rz.loss - sz.loss)]
                 + [float(np.abs(a - b).max()) for a, b in
                    zip([*rx.logprobs, *rz.logprobs], [*sx.logprobs, *sz.logprobs], strict=True)]
                 + [float((a - b).abs().max()) for a, b in
                    zip(grads["z"], grads2["z"], strict=True)])
    n = min(ry.logprobs[0].size, sy.logprobs[0].size)
    own = float(np.abs(ry.logprobs[0][:n] - sy.logprobs[0][:n]).max())
    return others, own


@pytest.fixture
def xyz(engine, add):
    for i, name in enumerate("xyz"):
        _add_trained_looking(add, engine, name, LoraSpec(rank=4, alpha=8, seed=10 + i))


def test_changing_one_datum_changes_no_other_datums_outputs(engine, xyz):
    # Same length: every shape is the same, so the others' numbers are exactly the same.
    others, own = _other_outputs_after_changing_one_datum(engine, new_length=40)
    assert others == 0.0
    assert own > 1e-2  # the changed datum's own outputs did change
    # Another length: the pass's GEMMs change shape, so float32 rounding (numerics.py).
    others, _ = _other_outputs_after_changing_one_datum(engine, new_length=17)
    assert others <= LOGPROB_ATOL


def test_the_check_above_fails_when_position_ids_restart_but_attention_crosses_datums(
        engine, xyz, monkeypatch):
    # The same packed pass with the per-datum attention taken away: position ids still
    # restart at each datum, but attention is causal over the whole row, so x's and z's
    # outputs follow y's tokens. The check above must see it.
    monkeypatch.setattr(packing, "datum_lengths", lambda cu_seq_lens, tokens: [tokens])
    others, _ = _other_outputs_after_changing_one_datum(engine, new_length=40)
    assert others > 100 * LOGPROB_ATOL


def test_adapter_merged_with_mixed_lengths_equals_alone(engine, add):
    spec = LoraSpec(rank=8, alpha=16, seed=21)
    _add_trained_looking(add, engine, "alone", spec)
    _add_trained_looking(add, engine, "merged", spec)
    _add_trained_looking(add, engine, "o1", LoraSpec(rank=2, alpha=4, seed=22))
    _add_trained_looking(add, engine, "o2", LoraSpec.from_tinker(rank=16, seed=23))
    rng = np.random.default_rng(2)
    vocab = engine.base.vocab_size
    mine = [_datum(rng, n, vocab) for n in (3, 70, 24)]
    alone, alone_grads = _run(engine, [ForwardRequest("alone", mine, CE, True)], packed=True)
    merged, merged_grads = _run(engine, [
        ForwardRequest("o1", [_datum(rng, n, vocab) for n in (100, 1)], CE, True),
        ForwardRequest("merged", mine, CE, True),
        ForwardRequest("o2", [_datum(rng, n, vocab) for n in (9, 55)], CE, False)],
        packed=True)
    _assert_close_results([merged[1]], alone)
    for got, want in zip(merged_grads["merged"], alone_grads["alone"], strict=True):
        assert_grads_close(got, want)


# ---------------------------------------------------------------- the attention mask


def _packed_row(engine, lengths):
    rng = np.random.default_rng(3)
    return [rng.integers(3, engine.base.vocab_size, n) for n in lengths]


def _transformers_causal_mask(config, embeds, attention_mask, positions):
    """transformers' `create_causal_mask` with no cache, under each 5.x spelling of its
    arguments (`input_embeds`/`inputs_embeds`, `past_key_values`/`cache`, and the
    `cache_position` that 5.0 requires)."""
    params = inspect.signature(create_causal_mask).parameters
    kwargs = {"config": config, "attention_mask": attention_mask, "position_ids": positions,
              "inputs_embeds" if "inputs_embeds" in params else "input_embeds": embeds,
              "cache" if "cache" in params else "past_key_values": None}
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(embeds.shape[1])
    return create_causal_mask(**kwargs)


def test_transformers_builds_a_block_diagonal_mask_from_restarting_position_ids(engine):
    # What transformers does on its own (masking_utils.find_packed_sequence_indices):
    # with no 2D mask and no cache, restarting position ids give "causal AND same datum".
    config = engine.base.model.config
    lengths = (3, 1, 4)
    layout = PassLayout(lengths, packed=True)
    positions = layout.model_inputs(engine.base, _packed_row(engine, lengths))["position_ids"]
    assert positions.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    datum = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    embeds = torch.zeros(1, 8, config.hidden_size)
    mask = _transformers_causal_mask(config, embeds, None, positions)
    assert torch.equal(mask[0, 0], causal & (datum[:, None] == datum[None]))
    # A 2D attention mask turns the detection off: causal across the whole row.
    mask = _transformers_causal_mask(config, embeds, torch.ones(1, 8, dtype=torch.long),
                                     positions)
    assert mask is None or torch.equal(mask[0, 0], causal)


def test_packed_attention_matches_each_datum_alone_and_transformers_dense_mask(engine):
    # Three computations of the same datums' last hidden states (base model, no adapter):
    # ours (packed_attention, one sdpa call per datum), transformers' dense block mask
    # (the same packed inputs with the model's own sdpa), and each datum in its own pass.
    # Float32 sums of at most 4096 terms either way: LOGPROB_ATOL's bound.
    base = engine.base
    lengths = (5, 1, 33, 33, 33, 12)  # the three 33s: one batched attention call
    ids = _packed_row(engine, lengths)
    layout = PassLayout(lengths, packed=True)
    inputs = layout.model_inputs(base, ids)
    with torch.no_grad():
        with packing.attention(base.model, layout):
            assert base.model.config._attn_implementation == packing.PACKED_ATTENTION
            ours = layout.row_tokens(base.hidden_states(**inputs, use_cache=False))
        assert base.model.config._attn_implementation == "sdpa"
        dense = base.hidden_states(input_ids=inputs["input_ids"],
                                   position_ids=inputs["position_ids"], use_cache=False)[0]
        alone = torch.cat([base.hidden_states(input_ids=torch.from_numpy(i)[None],
                                              use_cache=False)[0] for i in ids])
    torch.testing.assert_close(ours, alone, rtol=0, atol=LOGPROB_ATOL)
    torch.testing.assert_close(dense, alone, rtol=0, atol=LOGPROB_ATOL)


def test_packed_attention_keeps_a_sliding_window_inside_each_datum():
    # Against a dense reference mask: causal, same datum, and key within the window.
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=generator) for _ in range(3))
    lengths, window = (5, 5, 2), 3
    bounds = torch.tensor([0, 5, 10, 12], dtype=torch.int32)
    got, _ = packing.packed_attention(module, q, k, v, None, sliding_window=window,
                                      cu_seq_lens_q=bounds)
    datum = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    i = torch.arange(12)
    mask = (datum[:, None] == datum[None]) & (i[:, None] >= i[None]) & (i[:, None] - i[None] < window)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=1e-6)



def _per_datum(attention, module, q, k, v, window, **kwargs):
    """`attention` (a model's own eager attention) run on each datum of the packed row
    bounded at 0, 5, 10, 12 alone, with the causal (and `window`'s) mask; concatenated."""
    want = []
    for start, end in ((0, 5), (5, 10), (10, 12)):
        i = torch.arange(end - start)
        keep = i[:, None] >= i[None]
        if window is not None:
            keep &= i[:, None] - i[None] < window
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))[None, None]
        want.append(attention(module, q[:, :, start:end], k[:, :, start:end],
                              v[:, :, start:end], mask, **kwargs)[0])
    return torch.cat(want, dim=1)

def test_packed_attention_keeps_gpt_oss_attention_sinks_per_datum():
    # gpt-oss adds a learned sink logit per head to each softmax (`module.sinks`, passed
    # as `s_aux`); the reference is transformers' own gpt-oss eager attention, one datum
    # at a time, with its causal (and sliding-window) mask.
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 2, False
    generator = torch.Generator().manual_seed(6)
    module.sinks = torch.nn.Parameter(torch.randn(4, generator=generator))
    q = torch.randn(1, 4, 12, 8, generator=generator)
    k, v = (torch.randn(1, 2, 12, 8, generator=generator) for _ in range(2))
    bounds = torch.tensor([0, 5, 10, 12], dtype=torch.int32)
    for window in (None, 3):
        got, _ = packing.packed_attention(module, q, k, v, None, scaling=0.3,
                                          sliding_window=window, cu_seq_lens_q=bounds,
                                          s_aux=module.sinks)
        want = _per_datum(eager_attention_forward, module, q, k, v, window, scaling=0.3)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_packed_attention_applies_gemma2s_logit_soft_cap_per_datum():
    # Gemma 2 caps its attention logits (`softcap`: tanh(s / cap) * cap before the mask);
    # the reference is transformers' own Gemma 2 eager attention, one datum at a time.
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 2, False
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, 12, 8, generator=generator) * 4
    k, v = (torch.randn(1, 2, 12, 8, generator=generator) * 4 for _ in range(2))
    bounds = torch.tensor([0, 5, 10, 12], dtype=torch.int32)
    for window in (None, 3):
        got, _ = packing.packed_attention(module, q, k, v, None, scaling=0.3, softcap=2.0,
                                          sliding_window=window, cu_seq_lens_q=bounds)
        uncapped, _ = packing.packed_attention(module, q, k, v, None, scaling=0.3,
                                               sliding_window=window, cu_seq_lens_q=bounds)
        want = _per_datum(eager_attention_forward, module, q, k, v, window, scaling=0.3,
                          softcap=2.0)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert (got - uncapped).abs().max() > 0.1   # the cap bites at these scores


def test_a_model_passing_an_attention_argument_the_engine_does_not_compute_is_refused():
    # An argument with a value that packed and decode attention would drop (here T5's
    # `position_bias`) is refused at load, naming it; one without a value is not.
    torch.manual_seed(0)
    config = family_config("llama", 300, pad_token_id=0)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval()
    packing.check_attention(model, "LlamaForCausalLM")
    for extra in (None, torch.zeros(1)):
        for layer in model.model.layers:
            layer.self_attn.forward = (lambda *a, _f=type(layer.self_attn).forward.__get__(
                layer.self_attn), _x=extra, **kw: _f(*a, position_bias=_x, **kw))
        if extra is None:
            packing.check_attention(model, "LlamaForCausalLM")
            continue
        with pytest.raises(InvalidArgument, match=r"LlamaForCausalLM's attention layers "
                                                  r"pass \['position_bias'\]"):
            packing.check_attention(model, "LlamaForCausalLM")
    assert model.config._attn_implementation == "sdpa"
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"does not compute \['position_bias'\]"):
        packing.packed_attention(torch.nn.Module(), q, q, q, None, position_bias=q,
                                 cu_seq_lens_q=torch.tensor([0, 4], dtype=torch.int32))


def test_packed_attention_refuses_a_row_without_boundaries():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        packing.packed_attention(torch.nn.Module(), q, q, q, None)
    with pytest.raises(ValueError, match="do not span"):
        packing.packed_attention(torch.nn.Module(), q, q, q, None,
                                 cu_seq_lens_q=torch.tensor([0, 3], dtype=torch.int32))


# ---------------------------------------------------------------- layout and routing


def test_layout_reads_packed_and_padded_outputs_as_the_same_rows():
    layout_packed, layout_padded = PassLayout((2, 3), True), PassLayout((2, 3), False)
    assert layout_packed.offsets == (0, 2) and layout_packed.total == 5
    packed_out = torch.arange(5.0)[None, :, None]
    padded_out = torch.tensor([[0.0, 1.0, -1.0], [2.0, 3.0, 4.0]])[..., None]
    assert torch.equal(layout_packed.row_tokens(packed_out),
                       layout_padded.row_tokens(padded_out))


def test_token_routing_gives_each_segment_its_adapter_with_one_matmul_per_segment(
        monkeypatch):
    router = Router()
    layer = MultiLoraLinear(torch.nn.Linear(6, 5), router)
    generator = torch.Generator().manual_seed(0)
    weights = {name: LoraWeights(6, 5, LoraSpec(rank=2, alpha=2), generator)
               for name in ("a", "b")}
    for w in weights.values():
        torch.nn.init.normal_(w.lora_B, generator=generator)
    layer.adapters.update(weights)
    calls = []
    delta = LoraWeights.delta
    monkeypatch.setattr(LoraWeights, "delta",
                        lambda self, x, train=False: calls.append(x.shape) or delta(self, x, train))
    x = torch.randn(1, 9, 6, generator=generator)
    # Datums of 2 and 3 tokens for a, one of 1 for the base, 3 for b: three segments.
    with router.route_tokens([2, 3, 1, 3], ["a", "a", None, "b"], [True, True, False, False]):
        assert router.axis == TOKENS
        assert [(s.adapter_id, s.start, s.end) for s in router.segments] == [
            ("a", 0, 5), (None, 5, 6), ("b", 6, 9)]
        got = layer(x)
        flat = layer(x[0])  # the flat [tokens, in] layout routes the same way
    assert router.axis == ROWS and router.segments == ()
    assert calls == [(1, 5, 6), (1, 3, 6), (5, 6), (3, 6)]
    base = layer.base_layer(x)
    torch.testing.assert_close(got[:, :5], base[:, :5] + weights["a"].delta(x[:, :5]))
    torch.testing.assert_close(got[:, 5], base[:, 5], rtol=0, atol=0)
    torch.testing.assert_close(got[:, 6:], base[:, 6:] + weights["b"].delta(x[:, 6:]))
    torch.testing.assert_close(flat, got[0], rtol=0, atol=0)
    with router.route_tokens([2, 3], ["a", "a"]), pytest.raises(ValueError, match="cover 5"):
        layer(x)


def test_the_merge_budget_counts_real_tokens_and_packing_is_a_server_flag():
    rng = np.random.default_rng(4)
    request = ForwardRequest("a", [_datum(rng, n, 100) for n in (32, 1024, 7)], CE, True)
    assert request.num_tokens == 32 + 1024 + 7  # not 3 x 1024: no padding is counted
    assert ServerConfig().packing == "on"
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_args(parser.parse_args(["--packing", "off"])).packing == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["--packing", "maybe"])
