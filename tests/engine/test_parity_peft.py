"""The engine against a plain transformers + peft + torch.optim loop (the reference)."""

from __future__ import annotations

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from twinkle_server.engine.engine import ForwardRequest
from twinkle_server.engine.types import AdamParams, LoraSpec, LossSpec

from ..numerics import assert_trained_alike

CE = LossSpec("cross_entropy")
ADAM = AdamParams(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)


def peft_model(engine, path, trainable: bool = True) -> PeftModel:
    """The base reloaded from disk with a saved adapter, as any PEFT user would load it."""
    base = AutoModelForCausalLM.from_pretrained(engine.base.model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(path), is_trainable=trainable)


def peft_logprobs(model, datum) -> torch.Tensor:
    ids = torch.from_numpy(datum.input_ids)[None]
    logits = model(input_ids=ids).logits[0].float()
    targets = torch.from_numpy(datum.loss_inputs["target_tokens"])
    return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")


def test_three_adamw_steps_match_a_plain_peft_loop(engine, datums, add, snapshot, tmp_path):
    add("parity", LoraSpec(rank=8, alpha=16, seed=7, target_modules="all-linear"))
    engine.save_weights("parity", tmp_path / "init")
    model = peft_model(engine, tmp_path / "init")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2),
                            eps=ADAM.eps, weight_decay=ADAM.weight_decay)
    batch = datums[:4]  # different lengths: the engine pads, PEFT runs each alone
    for _ in range(3):
        out = engine.forward_batch([ForwardRequest("parity", batch, CE, True)])[0]
        metrics = engine.optim_step("parity", ADAM)
        loss = sum(-(peft_logprobs(model, d) * torch.from_numpy(d.loss_inputs["weights"])).sum()
                   for d in batch)
        assert abs(out.loss - loss.item()) <= 1e-4 * abs(loss.item())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, float("inf"))
        assert abs(metrics["grad_norm"] - float(norm)) <= 1e-4 * float(norm)
        opt.step()
        opt.zero_grad()
    peft_weights = {k.replace(".default", ""): v for k, v in model.state_dict().items()
                    if "lora_" in k}
    # Padded batch against one datum at a time, our layer against PEFT's: a rounding apart.
    assert_trained_alike(snapshot("parity"), peft_weights, ADAM.learning_rate, steps=3)


def test_gradient_accumulation_of_two_half_batches_equals_one_full_batch(engine, datums, add,
                                                                         snapshot):
    spec = LoraSpec(rank=4, alpha=8, seed=3)
    add("accum", spec, gradient_accumulation_steps=2)
    add("full", spec)
    for name in ("accum", "full"):
        engine.set_loss(name, LossSpec("CrossEntropyLoss"))
        engine.set_optimizer(name, "AdamW", {"lr": 1e-3})
    # Equal-size micro-batches with equal token counts: the mean of two token means is
    # the token mean of the union only then.
    full = datums[:4] * 2
    for _ in range(2):
        for micro in (full[:4], full[4:]):
            engine.forward_batch([ForwardRequest("accum", micro, None, True)])
            engine.clip_grad_norm("accum", 0.0)
            engine.step("accum")
            engine.zero_grad("accum")
            engine.lr_step("accum")
        engine.forward_batch([ForwardRequest("full", full, None, True)])
        engine.step("full")
        engine.zero_grad("full")
    assert engine.adapters["accum"].step == engine.adapters["full"].step == 2
    assert engine.adapters["accum"].micro_step == 4
    # 4-row passes against 8-row ones, two gradients added against one: a rounding apart.
    assert_trained_alike(snapshot("accum"), snapshot("full"), 1e-3, steps=2)


def test_accumulation_applies_the_optimizer_only_every_kth_step(engine, datums, add, snapshot):
    add("k3", LoraSpec(rank=2, alpha=2, seed=1), gradient_accumulation_steps=3)
    engine.set_loss("k3", LossSpec("CrossEntropyLoss"))
    engine.set_optimizer("k3", "SGD", {"lr": 0.1})
    start = snapshot("k3")
    applied = []
    for _ in range(3):
        engine.forward_batch([ForwardRequest("k3", datums[:1], None, True)])
        applied.append(engine.step("k3")["applied"])
        engine.zero_grad("k3")  # a no-op inside the window: the gradients keep adding up
        grads = [p.grad for p in engine.adapters["k3"].parameters()]
        assert all(g is not None for g in grads) == (len(applied) < 3)
        # Exact: inside the window no step touches the weights.
        unchanged = all(torch.equal(start[k], v) for k, v in snapshot("k3").items())
        assert unchanged == (len(applied) < 3)
    assert applied == [0.0, 0.0, 1.0]
