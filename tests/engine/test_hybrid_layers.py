"""Hybrid models whose layers carry state along a sequence train exactly: Qwen3.5 dense,
Qwen3.6 MoE and Qwen3-Next (Gated DeltaNet linear attention beside full attention) and
Nemotron-H (Mamba2 beside attention), tiny random configs from `tests/engine/families.py`.

Linear attention and Mamba run a causal conv1d and a recurrent state over the sequence,
so a packed pass (datums one after another in one sequence, `engine.packing`) must start
them afresh at each datum (`engine.recurrent`). Checked here per family: a packed pass
equals each datum alone and a padded pass; merged equals alone; the engine's forward with
an adapter equals transformers + peft's forward of the exported adapter; the loss falls.
Every adapter here names its linears (the mixers' projections, attention, dense MLPs);
the MoE families' experts under Tinker's default switches are tests/engine/test_experts.py's.

Different shapes of GEMMs on each side: numbers agree to tests/numerics.py's float32
tolerances, not bit for bit.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from twinkle_server.engine import recurrent
from twinkle_server.engine.engine import Engine, ForwardRequest
from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import (
    AdamParams,
    Datum,
    EngineLimits,
    LoraSpec,
    LossSpec,
    SampleRequest,
    SamplingParams,
)

from ..numerics import (
    LOGPROB_ATOL,
    LOSS_RTOL,
    STATE_GRAD_RTOL,
    STATE_LOGPROB_ATOL,
    assert_grads_close,
)
from .conftest import SENTENCES
from .families import (
    next_token_datums,
    peft_logprobs,
    randomize_b,
    skip_unchecked_mixers,
    write_family,
)

CE = LossSpec("cross_entropy")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS: dict[str, tuple[str, ...]] = {
    # Gated DeltaNet with separate input projections; a dense MLP.
    "qwen3_5_text": ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
                     *_ATTENTION, "gate_proj", "up_proj", "down_proj"),
    # Qwen3.6's MoE (its Gated DeltaNet as Qwen3.5's), mixers and attention only.
    "qwen3_5_moe_text": ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
                         *_ATTENTION),
    # Gated DeltaNet with fused input projections, attention (its MoE layers' shared and
    # routed experts under Tinker's switches: tests/engine/test_experts.py).
    "qwen3_next": ("in_proj_qkvz", "in_proj_ba", "out_proj", *_ATTENTION),
    # Mamba2 mixers' input projection (PEFT refuses their out_proj), attention, an MLP
    # layer and a MoE layer's shared expert.
    "nemotron_h": ("in_proj", *_ATTENTION, "up_proj", "down_proj"),
}
"""Family -> the linears its adapters train (PEFT suffixes)."""
FAMILIES = sorted(TARGETS)


@pytest.fixture(scope="module", params=FAMILIES)
def hybrid(request, tiny_cache, tmp_path_factory) -> Engine:
    """An engine on the family's tiny model, with its decode pool (which holds the
    mixers' states per row: `sampling.kv_batch`) beside the static sampler."""
    root = tmp_path_factory.mktemp("families")
    path = write_family(root, request.param, tiny_cache)
    skip_unchecked_mixers(request.param)
    engine = Engine.load(str(path), cache_dir=str(tiny_cache),
                         limits=EngineLimits(max_adapters=4, max_rank=16, max_seq_len=256,
                                             max_batch_tokens=4096))
    assert engine.sampling.pool is not None
    return engine


@pytest.fixture
def adapters(hybrid):
    """Adapter ids a test adds are removed after it."""
    added: list[str] = []
    yield added
    for name in added:
        hybrid.remove_adapter(name)


def _add(engine: Engine, added: list[str], name: str, seed: int,
         targets: str | tuple[str, ...] | None = None) -> None:
    """An adapter on `targets` (default: the family's `TARGETS`) whose B is random (a new
    adapter's delta is 0), so its LoRA changes every layer it targets."""
    engine.add_adapter(name, LoraSpec(rank=4, alpha=8, seed=seed,
                                      target_modules=targets or TARGETS[_family(engine)]))
    added.append(name)
    randomize_b(engine, name, seed, 0.1)


def _family(engine: Engine) -> str:
    return engine.base.config.model_type


def _datums(engine: Engine) -> list[Datum]:
    """Next-token datums of mixed lengths (3 to about 150 tokens: past the gated delta
    rule's 64-token chunks and Mamba2's 128), two of one length in a row."""
    return next_token_datums(engine, [SENTENCES[0], SENTENCES[7],
                                      " ".join(SENTENCES + SENTENCES[:4]), SENTENCES[7],
                                      "Hi there"])


def _run(engine: Engine, requests: list[ForwardRequest], packed: bool | None = True):
    """One pass's results, and each adapter's gradients from it; `packed` None: packed
    or padded as the engine chose."""
    previous = engine.packing
    engine.packing = previous if packed is None else packed
    try:
        for adapter in engine.adapters.values():
            adapter.zero_grad()
        results = engine.forward_batch(requests)
    finally:
        engine.packing = previous
    assert all(not isinstance(r, Exception) for r in results), results
    grads = {name: [p.grad.detach().clone() for p in adapter.parameters()]
             for name, adapter in engine.adapters.items()
             if any(r.adapter_id == name and r.backward for r in requests)}
    return results, grads


def _assert_logprobs_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=STATE_LOGPROB_ATOL)


def test_a_forward_backward_runs_on_the_tiny_model(hybrid, adapters):
    """What a Tinker user hit first: `forward_backward` on a hybrid failed with an internal
    ValueError (transformers' torch path refuses packed sequences it cannot keep apart)."""
    _add(hybrid, adapters, "first", seed=1)
    out = hybrid.forward_batch([ForwardRequest("first", _datums(hybrid)[:2], CE, True)])[0]
    assert not isinstance(out, Exception), out
    assert np.isfinite(out.loss)


def test_packed_pass_equals_each_datum_alone_and_the_padded_pass(hybrid, adapters):
    _add(hybrid, adapters, "a", seed=2)
    datums = _datums(hybrid)
    packed, packed_grads = _run(hybrid, [ForwardRequest("a", datums, CE, True)])
    padded, padded_grads = _run(hybrid, [ForwardRequest("a", datums, CE, True)], packed=False)
    alone = [_run(hybrid, [ForwardRequest("a", [d], CE, False)])[0][0] for d in datums]
    # A state carried over from the datum before would move every position of the next.
    _assert_logprobs_close(packed[0].logprobs, [r.logprobs[0] for r in alone])
    _assert_logprobs_close(padded[0].logprobs, [r.logprobs[0] for r in alone])
    assert packed[0].loss == pytest.approx(padded[0].loss, rel=LOSS_RTOL)
    for g, w in zip(packed_grads["a"], padded_grads["a"], strict=True):
        assert_grads_close(g, w, STATE_GRAD_RTOL)


def test_merged_pass_equals_each_adapter_alone(hybrid, adapters):
    _add(hybrid, adapters, "a", seed=3)
    _add(hybrid, adapters, "b", seed=4)
    datums = _datums(hybrid)
    requests = [ForwardRequest("a", datums[:3], CE, True),
                ForwardRequest("b", datums[2:], CE, True)]
    merged, merged_grads = _run(hybrid, requests)
    for request, result in zip(requests, merged, strict=True):
        (alone,), grads = _run(hybrid, [request])
        assert result.loss == pytest.approx(alone.loss, rel=LOSS_RTOL)
        _assert_logprobs_close(result.logprobs, alone.logprobs)
        for g, w in zip(merged_grads[request.adapter_id], grads[request.adapter_id],
                        strict=True):
            assert_grads_close(g, w, STATE_GRAD_RTOL)


def test_engine_forward_equals_peft_forward_of_the_export(hybrid, adapters, tmp_path):
    _add(hybrid, adapters, "export", seed=5)
    datums = _datums(hybrid)
    (ours,), _ = _run(hybrid, [ForwardRequest("export", datums, CE, False)])
    hybrid.save_weights("export", tmp_path / "export")
    base = AutoModelForCausalLM.from_pretrained(hybrid.base.model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path / "export")).eval()
    for datum, got in zip(datums, ours.logprobs, strict=True):
        np.testing.assert_allclose(got, peft_logprobs(model, datum), rtol=0,
                                   atol=STATE_LOGPROB_ATOL)


def test_the_loss_falls_over_four_steps(hybrid, adapters):
    hybrid.add_adapter("learn", LoraSpec(rank=8, alpha=16, seed=6,
                                         target_modules=TARGETS[_family(hybrid)]))
    adapters.append("learn")
    batch = _datums(hybrid)[:3]
    adam = AdamParams(learning_rate=1e-2)
    losses = []
    for _ in range(4):
        out = hybrid.forward_batch([ForwardRequest("learn", batch, CE, True)])[0]
        assert not isinstance(out, Exception), out
        losses.append(out.loss)
        hybrid.optim_step("learn", adam)
    assert all(b < a for a, b in zip(losses[:-1], losses[1:], strict=True)), losses


@pytest.mark.parametrize("hybrid", ["nemotron_h"], indirect=True)
def test_mamba_out_proj_is_left_out_as_peft_leaves_it(hybrid, adapters, tmp_path):
    """PEFT refuses LoRA on a Mamba model's `out_proj` (fused kernels read its weight
    raw), so an export targeting it would not load: a name that selects it is refused,
    and 'all-linear' trains every other linear."""
    with pytest.raises(InvalidArgument, match="out_proj"):
        hybrid.add_adapter("mamba_out", LoraSpec(rank=4, alpha=8, target_modules=("out_proj",)))
    hybrid.add_adapter("every", LoraSpec(rank=4, alpha=8, seed=7, target_modules="all-linear"))
    adapters.append("every")
    trained = hybrid.adapter_info("every")["target_modules"]
    assert "model.layers.0.mixer.in_proj" in trained
    assert not [name for name in trained if name.endswith("out_proj")]
    hybrid.save_weights("every", tmp_path / "every")
    base = AutoModelForCausalLM.from_pretrained(hybrid.base.model_dir, dtype=torch.float32)
    PeftModel.from_pretrained(base, str(tmp_path / "every"))  # loads: nothing PEFT refuses


def test_checkpointed_layers_replay_the_packed_mixers(hybrid, adapters, tiny_cache):
    """With activation checkpointing a decoder layer runs again in backward, after the
    pass's routing closed: its mixers run per datum again, under the same adapters."""
    _add(hybrid, adapters, "a", seed=8)
    datums = _datums(hybrid)
    want, want_grads = _run(hybrid, [ForwardRequest("a", datums, CE, True)])
    checkpointed = Engine.load(str(hybrid.base.model_dir), cache_dir=str(tiny_cache),
                               limits=hybrid.limits, activation_checkpointing=True)
    checkpointed.add_adapter("a", hybrid.adapters["a"].spec)
    with torch.no_grad():
        for name, weights in checkpointed.adapters["a"].weights.items():
            weights.lora_B.copy_(hybrid.adapters["a"].weights[name].lora_B)
    got, got_grads = _run(checkpointed, [ForwardRequest("a", datums, CE, True)])
    assert got[0].loss == pytest.approx(want[0].loss, rel=LOSS_RTOL)
    for g, w in zip(got_grads["a"], want_grads["a"], strict=True):
        assert_grads_close(g, w, STATE_GRAD_RTOL)


def test_a_stateful_layer_of_an_unknown_kind_pads_every_merged_pass(tiny_cache, tmp_path,
                                                                    caplog):
    """LFM2's short convolution is a kind `engine.recurrent` does not run per datum: the
    engine pads its merged passes (logged at start, naming it), never packs them wrong."""
    path = write_family(tmp_path, "lfm2", tiny_cache)
    with caplog.at_level(logging.WARNING, logger="twinkle_server.engine.engine"):
        engine = Engine.load(str(path), cache_dir=str(tiny_cache),
                             limits=EngineLimits(max_adapters=2, max_rank=16, max_seq_len=256,
                                                 max_batch_tokens=4096))
    assert not engine.packing
    assert "padded, not packed: Lfm2ShortConv" in caplog.text
    _add(engine, [], "a", seed=9, targets="all-linear")
    datums = _datums(engine)
    merged, _ = _run(engine, [ForwardRequest("a", datums, CE, False)], packed=None)
    alone = [_run(engine, [ForwardRequest("a", [d], CE, False)])[0][0] for d in datums]
    _assert_logprobs_close(merged[0].logprobs, [r.logprobs[0] for r in alone])
    # What the fallback spares: packed, the conv carries one datum into the next.
    packed, _ = _run(engine, [ForwardRequest("a", datums, CE, False)], packed=True)
    moved = max(float(np.abs(p - r.logprobs[0]).max())
                for p, r in zip(packed[0].logprobs, alone, strict=True))
    assert moved > 100 * LOGPROB_ATOL


@pytest.mark.parametrize(("lengths", "groups"), [
    ([7, 7, 7], [3]),            # equal lengths: one call, no padding
    ([4, 100], [2]),             # 96 padded positions beside 104 real ones
    ([100, 4, 4, 3], [2, 2]),    # the third short datum would pad past the real tokens
    ([60, 50, 1, 2, 40], [3, 2]),
])
def test_padding_groups_keep_the_padding_within_the_real_tokens(lengths, groups):
    assert recurrent.padding_groups(lengths) == groups
    first = 0
    for size in groups:
        group = lengths[first:first + size]
        assert size * max(group) - sum(group) <= sum(group)
        first += size


def test_static_sampling_keeps_each_rows_state_as_its_own(hybrid, adapters):
    """`--sampler static` on a hybrid: rows of two prompt lengths (left-padded) decode
    beside each other, one stopping first (the batch drops its row from the conv and
    recurrent states too); every sampled token's logprob is the one a teacher-forced
    pass of that row alone gives."""
    _add(hybrid, adapters, "s", seed=10)
    tokenizer = hybrid.base.tokenizer
    prompts = [np.asarray(tokenizer(text)["input_ids"], np.int64)
               for text in (SENTENCES[1], "Hi there")]
    requests = [SampleRequest("s", None, prompt, 2, SamplingParams(max_tokens=n, seed=3,
                                                                   ignore_eos=True))
                for prompt, n in zip(prompts, (3, 8), strict=True)]
    results = hybrid.sample_batch(requests)
    for request, result in zip(requests, results, strict=True):
        assert not isinstance(result, Exception), result
        for sequence in result:
            assert len(sequence.tokens) == request.params.max_tokens
            scored = hybrid.compute_logprobs(
                "s", None, np.concatenate([request.prompt, np.asarray(sequence.tokens)]))
            np.testing.assert_allclose(sequence.logprobs, scored[request.prompt.size:],
                                       rtol=0, atol=STATE_LOGPROB_ATOL)


def test_the_pool_decodes_two_tenants_adapters_as_the_trainer_scores_them(hybrid, adapters):
    """Two adapters' requests in one decode batch of the pool (rows joining, groups of
    samples, rows stopping): every sampled token's logprob is the one a teacher-forced
    pass of its own adapter gives (10 x STATE_LOGPROB_ATOL: one token a step through the
    cache against one pass, as tests/engine/test_engine.py's 10 x LOGPROB_ATOL)."""
    _add(hybrid, adapters, "alice", seed=11)
    _add(hybrid, adapters, "bob", seed=12)
    tokenizer = hybrid.base.tokenizer
    prompts = [np.asarray(tokenizer(text)["input_ids"], np.int64)
               for text in (SENTENCES[1], "Hi there", SENTENCES[3])]
    requests = [SampleRequest(name, None, prompt, n, SamplingParams(max_tokens=m, seed=i,
                                                                    ignore_eos=True))
                for i, (name, prompt, n, m) in enumerate(
                    [("alice", prompts[0], 2, 6), ("bob", prompts[1], 3, 9),
                     ("alice", prompts[2], 1, 4)])]
    results = dict(hybrid.decode(requests[:1], [0], 0.0))
    results.update(hybrid.decode(requests[1:], [1, 2], 0.0))
    for _ in range(100):
        if len(results) == len(requests):
            break
        results.update(hybrid.decode([], [], 0.0))
    for key, request in enumerate(requests):
        result = results[key]
        assert not isinstance(result, Exception), result
        for sequence in result.sequences:
            assert len(sequence.tokens) == request.params.max_tokens
            scored = hybrid.compute_logprobs(
                request.adapter_id, None,
                np.concatenate([request.prompt, np.asarray(sequence.tokens)]))
            np.testing.assert_allclose(sequence.logprobs, scored[request.prompt.size:],
                                       rtol=0, atol=10 * STATE_LOGPROB_ATOL)


@pytest.mark.parametrize("hybrid", ["qwen3_next"], indirect=True)
def test_shared_expert_lora_routes_rows_the_moe_block_flattens(hybrid, adapters):
    """A MoE block flattens `[rows, seq, hidden]` to `[rows * seq, hidden]` before its
    shared expert: under row routing (padded passes, sampling) each row's tokens still
    get their own adapter. Padded == packed, and a two-adapter static sample runs."""
    shared = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
    _add(hybrid, adapters, "a", seed=11, targets=shared)
    _add(hybrid, adapters, "b", seed=12, targets=shared + ("in_proj_qkvz",))
    datums = _datums(hybrid)
    requests = [ForwardRequest("a", datums[:2], CE, True),
                ForwardRequest("b", datums[2:], CE, True)]
    packed, packed_grads = _run(hybrid, requests)
    padded, padded_grads = _run(hybrid, requests, packed=False)
    for got, want in zip(padded, packed, strict=True):
        _assert_logprobs_close(got.logprobs, want.logprobs)
    for name in ("a", "b"):
        for g, w in zip(padded_grads[name], packed_grads[name], strict=True):
            assert_grads_close(g, w, STATE_GRAD_RTOL)
    prompt = np.asarray(hybrid.base.tokenizer(SENTENCES[1])["input_ids"], np.int64)
    results = hybrid.sample_batch([SampleRequest(name, None, prompt, 1,
                                                 SamplingParams(max_tokens=3, seed=1))
                                   for name in ("a", "b")])
    assert all(not isinstance(r, Exception) for r in results), results


def test_an_older_transformers_is_refused_by_name(tiny_cache, tmp_path):
    """Under a transformers the mixers were not checked on, the model is refused at load,
    naming the layers and both versions, never trained on unchecked numbers."""
    path = write_family(tmp_path, "qwen3_next", tiny_cache)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    refused = recurrent.refusal(model, "5.0.0")
    assert refused is not None and "Gated DeltaNet" in str(refused)
    assert "5.0.0" in str(refused) and recurrent.VERIFIED_TRANSFORMERS in str(refused)
    assert recurrent.refusal(model, recurrent.VERIFIED_TRANSFORMERS) is None

