"""The merged pass's output layer (issue 17): target logprobs from the last hidden states
in chunks of tokens (`engine.logprobs`), and activation checkpointing (`engine.activations`).

The reference is the computation the engine ran before, kept here and nowhere else: the
model's own `[rows, width, vocab]` logits of each request alone, log-softmax over the
whole vocabulary. The chunks are shrunk to a few tokens so that chunk boundaries fall
inside rows, on a random Qwen3 with a 32,768-token vocabulary (no download).

Tolerances: chunked against full logits, and merged against alone, run GEMMs of different
shapes, so they agree to the isolation contract's float32 bounds (tests/numerics.py:
LOSS_RTOL, LOGPROB_ATOL, GRAD_RTOL, derived at the top of engine.py). Checkpointing on
against off replays the same ops on the same shapes: exact.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from twinkle_server.engine import logprobs, losses
from twinkle_server.engine.base_model import BaseModel, check_output_head
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import Datum, EngineLimits, LoraSpec, LossSpec

from ..numerics import LOGPROB_ATOL, LOSS_RTOL, assert_grads_close, assert_topk_alike

VOCAB = 32_768
"""Eight times the tiny model's: large enough that a chunk is a real slice of a pass's
logits, small enough for a CPU test."""
CHUNK_TOKENS = 5
"""Positions per chunk in these tests: rows of 6 to 12 tokens straddle chunk boundaries."""
LIMITS = EngineLimits(max_adapters=8, max_rank=16, max_seq_len=256, max_batch_tokens=4096)
CE = LossSpec("cross_entropy")
HEAD = LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "lm_head"), seed=1)
BODY = LoraSpec(rank=4, alpha=8, target_modules="all-linear", seed=2)


def _random_base(tokenizer, vocab: int = VOCAB, seed: int = 0, arch: str = "qwen3",
                 **config) -> BaseModel:
    """A random 2-layer model (hidden 32) with `vocab` tokens, the same weights for the
    same seed; the tiny model's tokenizer only supplies the pad id."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kinds = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "gemma2": (Gemma2Config,
                                                                  Gemma2ForCausalLM)}
    config_class, model_class = kinds[arch]
    cfg = config_class(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                       pad_token_id=0, **config)
    cfg._attn_implementation = "sdpa" if arch == "qwen3" else "eager"  # Gemma 2: eager only
    torch.manual_seed(seed)
    model = model_class(cfg).eval().requires_grad_(False)
    return BaseModel(model=model, tokenizer=tokenizer, name=f"random-{arch}",
                     model_dir=Path("."), device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def wide(engine) -> Engine:
    """An engine on a random Qwen3 with a 32,768-token vocabulary."""
    base = _random_base(engine.base.tokenizer)
    check_output_head(base.model)
    return Engine(base, LIMITS)


@pytest.fixture
def small_chunks(monkeypatch) -> None:
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", CHUNK_TOKENS * VOCAB * 4)


@pytest.fixture
def adapters():
    """`adapters(engine, name, spec)` adds an adapter whose B is drawn at random (a new
    adapter's B is 0, so its delta and A's gradient would be 0); removed after the test."""
    made: list[tuple[Engine, str]] = []

    def _add(engine: Engine, name: str, spec: LoraSpec) -> None:
        engine.add_adapter(name, spec)
        made.append((engine, name))
        generator = torch.Generator().manual_seed(int(spec.seed or 0))
        with torch.no_grad():
            for weights in engine.adapters[name].weights.values():
                weights.lora_B.copy_(torch.randn(weights.lora_B.shape, generator=generator)
                                     * 0.05)
    yield _add
    for engine, name in made:
        engine.remove_adapter(name)


def _datum(rng: np.random.Generator, n: int, vocab: int, k: int = 0) -> Datum:
    """`n` random positions, weights with a zero; `k` > 0: `[n, k]` targets."""
    ids = rng.integers(3, vocab, n + 1)
    targets = ids[1:] if not k else np.stack(
        [ids[1:], *(rng.integers(3, vocab, n) for _ in range(k - 1))], 1)
    weights = np.ones(targets.shape, np.float32)
    weights[0] = 0.0
    return Datum(ids[:-1], {"target_tokens": targets, "weights": weights})


def _grads(engine: Engine, name: str) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in engine.adapters[name].parameters()]


def _reference(engine: Engine, request: ForwardRequest
               ) -> tuple[float, list[np.ndarray], float, list[torch.Tensor] | None]:
    """The request ALONE, the way the engine computed it before chunking: the model's full
    `[rows, width, vocab]` logits (its output layer on every padded position, LoRA
    included), log-softmax over the vocabulary, the argmax for the hits. Returns the
    loss, each datum's logprobs, the hit count and (backward) the adapter's gradients."""
    datums = request.datums
    lengths = [d.num_tokens for d in datums]
    width = max(lengths)
    ids = torch.zeros((len(datums), width), dtype=torch.long)
    for row, datum in enumerate(datums):
        ids[row, :datum.num_tokens] = torch.from_numpy(np.asarray(datum.input_ids))
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    adapter = engine.adapters[request.adapter_id]
    adapter.zero_grad()
    route = engine.router.route([request.adapter_id] * len(datums),
                                [request.backward] * len(datums))
    with torch.set_grad_enabled(request.backward), route:
        logits = engine.base.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    lps, inputs, hits = [], [], 0.0
    for row, datum in enumerate(datums):
        tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in datum.loss_inputs.items()}
        targets, rows = tensors["target_tokens"].long(), logits[row, :datum.num_tokens].float()
        if targets.ndim == 1:
            lps.append(-F.cross_entropy(rows, targets, reduction="none"))
            hits += float(((rows.argmax(-1) == targets) & (tensors["weights"] != 0)).sum())
        else:
            lps.append(torch.log_softmax(rows, dim=-1).gather(-1, targets))
        inputs.append(tensors)
    loss, _ = losses.compute_loss(request.loss, lps, inputs)
    grads = None
    if request.backward:
        loss.backward()
        grads = _grads(engine, request.adapter_id)
        adapter.zero_grad()
    return float(loss.detach()), [lp.detach().numpy() for lp in lps], hits, grads


def _check_against_reference(engine: Engine, requests: list[ForwardRequest]) -> None:
    """One merged pass of `requests` against each request alone through full logits."""
    want = [_reference(engine, r) for r in requests]
    for adapter in engine.adapters.values():
        adapter.zero_grad()
        adapter.train_metrics.__init__()
        adapter.eval_metrics.__init__()
    results = engine.forward_batch(requests)
    for request, result, (loss, lps, hits, grads) in zip(requests, results, want, strict=True):
        assert not isinstance(result, Exception), result
        assert result.loss == pytest.approx(loss, rel=LOSS_RTOL)
        for got, ref in zip(result.logprobs, lps, strict=True):
            assert got.shape == ref.shape
            np.testing.assert_allclose(got, ref, rtol=0, atol=LOGPROB_ATOL)
        adapter = engine.adapters[request.adapter_id]
        book = adapter.train_metrics if request.backward else adapter.eval_metrics
        # The argmax of logits that agree to 1e-6: the same token unless two logits lie
        # within rounding of each other at the top (random logits: never here).
        assert book.correct == hits
        if grads is not None:
            for got, ref in zip(_grads(engine, request.adapter_id), grads, strict=True):
                assert_grads_close(got, ref)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_chunked_logprobs_losses_and_grads_equal_full_logits(wide, adapters, small_chunks,
                                                             packed):
    """Rows of three adapters in one pass (one with LoRA on lm_head, one trained only in
    the body, one evaluated), rows of 6 to 12 tokens cut by 5-token chunks, [T] and
    [T, K] targets side by side."""
    adapters(wide, "head", HEAD)
    adapters(wide, "body", BODY)
    adapters(wide, "eval", LoraSpec(rank=2, alpha=4, target_modules=("lm_head",), seed=3))
    rng = np.random.default_rng(0)
    requests = [
        ForwardRequest("head", [_datum(rng, 7, VOCAB), _datum(rng, 12, VOCAB)], CE, True),
        ForwardRequest("body", [_datum(rng, 9, VOCAB), _datum(rng, 6, VOCAB, k=3)],
                       CE, True),
        ForwardRequest("eval", [_datum(rng, 8, VOCAB)], CE, False),
    ]
    previous, wide.packing = wide.packing, packed
    try:
        _check_against_reference(wide, requests)
    finally:
        wide.packing = previous


def test_native_and_ratio_losses_equal_full_logits(wide, adapters, small_chunks):
    """Every loss reads the same logprobs: a native loss (normalised) and a ratio loss
    over the chunked logprobs equal those over the full logits."""
    adapters(wide, "head", HEAD)
    adapters(wide, "body", BODY)
    rng = np.random.default_rng(1)
    ppo = []
    for n in (11, 4):
        datum = _datum(rng, n, VOCAB)
        ppo.append(Datum(datum.input_ids, {
            **datum.loss_inputs, "logprobs": rng.normal(-10.4, 0.1, n).astype(np.float32),
            "advantages": rng.normal(0, 1, n).astype(np.float32)}))
    _check_against_reference(wide, [
        ForwardRequest("head", ppo, LossSpec("ppo"), True),
        ForwardRequest("body", [_datum(rng, 13, VOCAB)], LossSpec("CrossEntropyLoss"), True),
    ])


def test_tiny_model_chunks_equal_full_logits(engine, adapters, datums, monkeypatch):
    """The session's tiny model (4,096 tokens), chunks of 5 positions, LoRA on lm_head."""
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", CHUNK_TOKENS * 4096 * 4)
    adapters(engine, "tiny-head", LoraSpec(rank=4, alpha=8, seed=4,
                                           target_modules=("o_proj", "lm_head")))
    _check_against_reference(engine, [ForwardRequest("tiny-head", datums[:3], CE, True)])


def test_prompt_logprobs_in_chunks_equal_full_logits(wide, adapters, small_chunks):
    """`prompt_logprobs` with top-k through an lm_head adapter: chunked == full logits."""
    adapters(wide, "head", HEAD)
    tokens = np.random.default_rng(2).integers(3, VOCAB, 13)
    got = wide.prompt_logprobs("head", None, tokens, topk=4)
    ids = torch.from_numpy(tokens)[None]
    with torch.no_grad(), wide.router.route(["head"]):
        logp = torch.log_softmax(wide.base.model(input_ids=ids).logits[0, :-1].float(), -1)
    np.testing.assert_allclose(got.logprobs[1:], logp.gather(-1, ids[0, 1:, None])[:, 0],
                               rtol=0, atol=LOGPROB_ATOL)
    # Chunks against one GEMM over every position, a rounding apart: the same top 4 up to
    # tokens whose logprobs are within rounding (`numerics.assert_topk_alike`).
    assert_topk_alike(got.topk_token_ids[1:], got.topk_logprobs[1:], logp.numpy())
    assert np.isnan(got.logprobs[0])


def test_softcapped_logits_are_chunked_with_their_cap(engine, monkeypatch):
    """Gemma 2's final soft-cap is applied per chunk; without it the load check refuses
    the model instead of training on wrong logprobs."""
    base = _random_base(engine.base.tokenizer, vocab=2048, arch="gemma2",
                        final_logit_softcapping=0.5, attn_logit_softcapping=None)
    check_output_head(base.model)
    monkeypatch.setattr(logprobs, "LOGITS_CHUNK_BYTES", CHUNK_TOKENS * 2048 * 4)
    gemma = Engine(base, LIMITS)
    gemma.add_adapter("g", HEAD)
    rng = np.random.default_rng(3)
    _check_against_reference(gemma, [
        ForwardRequest("g", [_datum(rng, 9, 2048), _datum(rng, 4, 2048, k=2)], CE, True)])
    from twinkle_server.engine import base_model

    monkeypatch.setattr(base_model, "final_logit_transform", lambda config: None)
    with pytest.raises(InvalidArgument, match="cannot serve this architecture"):
        check_output_head(_random_base(engine.base.tokenizer, vocab=2048, arch="gemma2",
                                       final_logit_softcapping=0.5,
                                       attn_logit_softcapping=None).model)


def test_a_model_that_changes_its_logits_otherwise_is_refused(engine):
    base = _random_base(engine.base.tokenizer, vocab=512)
    forward = base.model.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 3.0
        return out

    base.model.forward = scaled
    with pytest.raises(InvalidArgument, match="logits are not its output layer"):
        check_output_head(base.model)


def _checkpointing_pass(tokenizer, checkpointing: bool, packed: bool
                        ) -> tuple[list, dict[str, list[torch.Tensor]], int]:
    """One forward_backward of two adapters (LoRA dropout 0.1, so the replay must draw the
    same masks) on a fresh random base; results, gradients, and how many times the first
    layer's attention ran."""
    engine = Engine(_random_base(tokenizer, vocab=4096), LIMITS, packing=packed,
                    activation_checkpointing=checkpointing)
    calls = []
    engine.base.model.model.layers[0].self_attn.register_forward_hook(
        lambda *args: calls.append(1))
    for name, spec in (("head", HEAD), ("body", BODY)):
        engine.add_adapter(name, replace(spec, dropout=0.1))
        generator = torch.Generator().manual_seed(int(spec.seed))
        with torch.no_grad():
            for weights in engine.adapters[name].weights.values():
                weights.lora_B.copy_(torch.randn(weights.lora_B.shape, generator=generator)
                                     * 0.05)
    rng = np.random.default_rng(4)
    requests = [ForwardRequest("head", [_datum(rng, 7, 4096), _datum(rng, 12, 4096)], CE, True),
                ForwardRequest("body", [_datum(rng, 9, 4096)], CE, True)]
    torch.manual_seed(0)
    results = engine.forward_batch(requests)
    grads = {name: _grads(engine, name) for name in ("head", "body")}
    return results, grads, len(calls)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_activation_checkpointing_gives_the_same_losses_and_gradients(engine, packed):
    """Recomputed layers replay under the pass's routing, attention and dropout masks:
    the same ops on the same shapes, so results and gradients are exact."""
    off, off_grads, off_calls = _checkpointing_pass(engine.base.tokenizer, False, packed)
    on, on_grads, on_calls = _checkpointing_pass(engine.base.tokenizer, True, packed)
    assert (off_calls, on_calls) == (1, 2)  # on: the layer ran again in backward
    for got, want in zip(on, off, strict=True):
        assert got.loss == want.loss
        for lg, lw in zip(got.logprobs, want.logprobs, strict=True):
            np.testing.assert_array_equal(lg, lw)
    for name in off_grads:
        for got, want in zip(on_grads[name], off_grads[name], strict=True):
            assert torch.equal(got, want), name


def test_activation_checkpointing_leaves_the_base_in_eval_mode(engine):
    """Only the decoder layers' own flag is set: the base's dropout stays off. (The
    multi-LoRA wrappers' flag is never read: dropout follows the router's segments.)"""
    checkpointed = Engine(_random_base(engine.base.tokenizer, vocab=512), LIMITS,
                          activation_checkpointing=True)
    model = checkpointed.base.model
    layers = list(model.model.layers)
    assert all(layer.training and layer.gradient_checkpointing for layer in layers)
    training = {type(m).__name__ for m in model.modules()
                if m.training and not any(m is layer for layer in layers)}
    assert training <= {"MultiLoraLinear"}


def test_auto_checkpointing_stays_off_for_a_model_transformers_cannot_checkpoint(engine):
    from twinkle_server.engine import activations

    assert activations.auto(engine.base.model, True) is True
    assert activations.auto(engine.base.model, False) is False
    # No decoder layer transformers knows how to checkpoint: `on` would refuse to start.
    assert activations.auto(torch.nn.Linear(2, 2), True) is False
    with pytest.raises(InvalidArgument, match="--activation-checkpointing: Linear"):
        activations.enable(torch.nn.Linear(2, 2), engine.router)
