"""The engine against plain PEFT, against itself alone vs merged, and its error paths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from twinkle_server.engine.engine import ForwardRequest, SampleRequest
from twinkle_server.engine.errors import InvalidArgument, NotFound, ResourceExhausted
from twinkle_server.engine.types import AdamParams, Datum, LoraSpec, LossSpec, SamplingParams

CE = LossSpec("cross_entropy")
ADAM = AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


def _add(engine, fresh, name, spec, **kw):
    engine.add_adapter(name, spec, **kw)
    fresh.append(name)


def _weights(engine, name):
    return {k: v.detach().clone() for k, v in engine._peft_tensors(engine.adapters[name]).items()}


def _max_diff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _peft_model(engine, path):
    base = AutoModelForCausalLM.from_pretrained(engine.base.model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(path), is_trainable=True)


def _peft_logprobs(model, datum):
    ids = torch.from_numpy(datum.input_ids)[None]
    logits = model(input_ids=ids).logits[0].float()
    targets = torch.from_numpy(datum.loss_inputs["target_tokens"])
    return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")


def test_three_adamw_steps_match_a_plain_peft_loop(engine, datums, fresh, tmp_path):
    _add(engine, fresh, "parity", LoraSpec(rank=8, alpha=16, seed=7))
    engine.save_weights("parity", tmp_path / "init")
    model = _peft_model(engine, tmp_path / "init")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                            eps=ADAM.eps, weight_decay=ADAM.weight_decay)
    batch = datums[:4]
    for _ in range(3):
        engine.forward_batch([ForwardRequest("parity", batch, CE, True)])
        engine.optim_step("parity", ADAM)
        loss = sum(-(_peft_logprobs(model, d) * torch.from_numpy(d.loss_inputs["weights"])).sum()
                   for d in batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    peft_weights = {k.replace(".default", ""): v for k, v in model.state_dict().items()
                    if "lora_" in k}
    assert _max_diff(_weights(engine, "parity"), peft_weights) <= 1e-5


def test_gradient_accumulation_of_two_half_batches_equals_one_full_batch(engine, datums, fresh):
    spec = LoraSpec(rank=4, alpha=8, seed=3)
    _add(engine, fresh, "accum", spec, gradient_accumulation_steps=2)
    _add(engine, fresh, "full", spec)
    for name in ("accum", "full"):
        engine.set_loss(name, LossSpec("CrossEntropyLoss"))
        engine.set_optimizer(name, "AdamW", {"lr": 1e-3})
    equal = [d for d in datums if d.num_tokens == datums[0].num_tokens] or datums[:1]
    half = equal * 2
    for _ in range(2):
        for micro in (half[:len(half) // 2], half[len(half) // 2:]):
            engine.forward_batch([ForwardRequest("accum", micro, None, True)])
            engine.clip_grad_norm("accum", 0.0)
            engine.step("accum")
            engine.zero_grad("accum")
        engine.forward_batch([ForwardRequest("full", half, None, True)])
        engine.step("full")
        engine.zero_grad("full")
    assert engine.adapters["accum"].step == engine.adapters["full"].step == 2
    assert _max_diff(_weights(engine, "accum"), _weights(engine, "full")) <= 1e-5


def test_adapter_trained_merged_with_three_others_equals_trained_alone(engine, datums, fresh):
    spec = LoraSpec(rank=8, alpha=16, seed=11)
    _add(engine, fresh, "alone", spec)
    _add(engine, fresh, "merged", spec)
    others = [("o1", LoraSpec(rank=2, alpha=4, seed=1, target_modules=("q_proj", "v_proj"))),
              ("o2", LoraSpec.from_tinker(rank=16, seed=2)),
              ("o3", LoraSpec(rank=4, alpha=4, seed=3, target_modules=("down_proj",)))]
    for name, other in others:
        _add(engine, fresh, name, other)
    for _ in range(3):
        engine.forward_batch([ForwardRequest("alone", datums[:3], CE, True)])
        results = engine.forward_batch(
            [ForwardRequest("o1", datums[3:5], CE, True),
             ForwardRequest("merged", datums[:3], CE, True),
             ForwardRequest("o2", datums[5:], CE, True),
             ForwardRequest("o3", datums[:2], CE, True)])
        assert all(not isinstance(r, Exception) for r in results)
        for name in ("alone", "merged", "o1", "o2", "o3"):
            engine.optim_step(name, ADAM)
    assert _max_diff(_weights(engine, "alone"), _weights(engine, "merged")) <= 1e-5


def test_one_requests_nan_loss_or_bad_batch_never_touches_another_adapter(engine, datums, fresh):
    _add(engine, fresh, "victim", LoraSpec(rank=4, alpha=8, seed=5))
    _add(engine, fresh, "bad", LoraSpec(rank=4, alpha=8, seed=6))
    _add(engine, fresh, "ref", LoraSpec(rank=4, alpha=8, seed=5))
    engine.forward_batch([ForwardRequest("ref", datums[:2], CE, True)])
    huge = Datum(datums[0].input_ids, {**datums[0].loss_inputs,
                                       "weights": np.full(datums[0].num_tokens, 3e38, np.float32)})
    out_of_vocab = Datum(np.array([1, 10**6]), {"target_tokens": np.array([1, 2])})
    results = engine.forward_batch([ForwardRequest("bad", [huge] * 3, CE, True),
                                    ForwardRequest("victim", datums[:2], CE, True),
                                    ForwardRequest("bad", [out_of_vocab], CE, True)])
    assert isinstance(results[0], InvalidArgument) and "not finite" in str(results[0])
    assert isinstance(results[2], InvalidArgument) and "outside the vocabulary" in str(results[2])
    victim, ref = engine.adapters["victim"], engine.adapters["ref"]
    for a, b in zip(victim.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert all(p.grad is None for p in engine.adapters["bad"].parameters())


def test_saved_adapter_gives_the_engines_logits_in_peft(engine, datums, fresh, tmp_path):
    _add(engine, fresh, "export", LoraSpec.from_tinker(rank=8, seed=9))
    for _ in range(2):
        engine.forward_batch([ForwardRequest("export", datums[:4], CE, True)])
        engine.optim_step("export", ADAM)
    engine.save_weights("export", tmp_path / "export")
    model = _peft_model(engine, tmp_path / "export").eval()
    ours = engine.forward_batch([ForwardRequest("export", datums[:1], CE, False)])[0]
    with torch.no_grad():
        theirs = _peft_logprobs(model, datums[0]).numpy()
    np.testing.assert_allclose(ours.logprobs[0], theirs, atol=1e-5)


def test_load_state_with_optimizer_resumes_to_the_uninterrupted_weights(
        engine, datums, fresh, tmp_path):
    spec = LoraSpec(rank=4, alpha=8, seed=21)
    _add(engine, fresh, "straight", spec)
    _add(engine, fresh, "first", spec)

    def train(name, steps):
        for _ in range(steps):
            engine.forward_batch([ForwardRequest(name, datums[:3], CE, True)])
            engine.optim_step(name, ADAM)

    train("straight", 4)
    train("first", 2)
    engine.save_state("first", tmp_path / "mid", include_optimizer=True)
    _add(engine, fresh, "resumed", engine.read_checkpoint_spec(tmp_path / "mid"))
    engine.load_state("resumed", tmp_path / "mid", include_optimizer=True)
    train("resumed", 2)
    assert engine.adapters["resumed"].step == 4
    assert _max_diff(_weights(engine, "straight"), _weights(engine, "resumed")) <= 1e-6


def test_limits_and_bad_requests_name_the_field(engine, datums, fresh):
    with pytest.raises(InvalidArgument, match=r"lora.rank: 65 is outside \[1, 64\]"):
        engine.add_adapter("x", LoraSpec(rank=65, alpha=8))
    with pytest.raises(InvalidArgument, match="'nope_proj' matches no linear layer"):
        engine.add_adapter("x", LoraSpec(rank=4, alpha=8, target_modules=("nope_proj",)))
    with pytest.raises(NotFound, match="no model 'ghost'"):
        engine.validate_forward(ForwardRequest("ghost", datums, CE, True))
    _add(engine, fresh, "v", LoraSpec(rank=4, alpha=8, seed=1))
    bad_len = Datum(datums[0].input_ids, {"target_tokens": datums[0].loss_inputs["target_tokens"],
                                          "weights": np.ones(3, np.float32)})
    with pytest.raises(InvalidArgument, match=r"datum\[0\].loss_fn_inputs\['weights'\]: length 3"):
        engine.validate_forward(ForwardRequest("v", [bad_len], CE, True))
    with pytest.raises(InvalidArgument, match="unknown loss 'hinge'"):
        engine.validate_forward(ForwardRequest("v", datums, LossSpec("hinge"), True))
    with pytest.raises(InvalidArgument, match="batch is empty"):
        engine.validate_forward(ForwardRequest("v", [], CE, True))
    long = Datum(np.zeros(300, np.int64), {"target_tokens": np.zeros(300, np.int64)})
    with pytest.raises(InvalidArgument, match="300 tokens is over the 256-token limit"):
        engine.validate_forward(ForwardRequest("v", [long], CE, True))
    while len(engine.adapters) < engine.limits.max_adapters:
        _add(engine, fresh, f"fill{len(engine.adapters)}", LoraSpec(rank=1, alpha=1, seed=0))
    with pytest.raises(ResourceExhausted, match="all 8 adapter slots are in use"):
        engine.add_adapter("one-too-many", LoraSpec(rank=1, alpha=1))


def test_loss_halves_within_thirty_steps(engine, datums, fresh):
    _add(engine, fresh, "learn", LoraSpec.from_tinker(rank=16, seed=4))
    first = last = None
    for _ in range(30):
        out = engine.forward_batch([ForwardRequest("learn", datums, CE, True)])[0]
        engine.optim_step("learn", AdamParams(learning_rate=2e-2))
        first = out.loss if first is None else first
        last = out.loss
    assert last <= 0.5 * first


def test_sampling_two_adapters_in_one_batch_matches_sampling_each_alone(engine, datums, fresh):
    _add(engine, fresh, "s1", LoraSpec.from_tinker(rank=4, seed=1))
    _add(engine, fresh, "s2", LoraSpec.from_tinker(rank=4, seed=2))
    for name in ("s1", "s2"):
        engine.forward_batch([ForwardRequest(name, datums[:2], CE, True)])
        engine.optim_step(name, AdamParams(learning_rate=5e-2))
    params = SamplingParams(max_tokens=8, seed=123)
    r1 = SampleRequest("s1", None, datums[0].input_ids[:4], 2, params)
    r2 = SampleRequest("s2", None, datums[1].input_ids[:6], 1, params)
    together = engine.sample_batch([r1, r2])
    alone = [engine.sample_batch([r])[0] for r in (r1, r2)]
    for a, b in zip(together, alone, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_sampled_logprobs_equal_a_teacher_forced_forward(engine, datums, fresh):
    _add(engine, fresh, "tf", LoraSpec.from_tinker(rank=4, seed=8))
    prompt = datums[2].input_ids[:5]
    seq = engine.sample_batch([SampleRequest("tf", None, prompt, 1,
                                             SamplingParams(max_tokens=6, seed=1,
                                                            stop_on_eos=False))])[0][0]
    full = np.concatenate([prompt, seq.tokens.astype(np.int64)])
    forced = engine.compute_logprobs("tf", None, full)[prompt.size:]
    np.testing.assert_allclose(seq.logprobs, forced, atol=1e-4)
    assert seq.stop_reason == "length" and seq.tokens.size == 6
