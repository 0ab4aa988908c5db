"""MultiLoraTransformersModel against a real server: the user's SFT loop trains, resume
with optimizer equals an uninterrupted run, accumulation 2 equals one double batch, two
models in one process equal their solo references, sampling is ordered after training,
and the LoRA config maps onto the wire or is refused naming the field."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from peft import LoraConfig
from safetensors.numpy import load_file

import twinkle_wire as wire
from twinkle_client import features
from twinkle_client.errors import FailedPreconditionError, InvalidArgumentError
from twinkle_client.futures import Future
from twinkle_client.lora import lora_spec
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.processor import InputProcessor, ProcessorError

from ..numerics import assert_trained_alike
from .conftest import toy_features

integration = pytest.mark.integration


def _weights(client, path: str, dest) -> dict[str, np.ndarray]:
    return load_file(str(client.download_checkpoint(path, dest) / "adapter_model.safetensors"))


def _assert_close(a: dict[str, np.ndarray], b: dict[str, np.ndarray], atol: float) -> None:
    assert sorted(a) == sorted(b)
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= atol, worst


def _model(lr: float = 1e-2, accum: int = 1, seed: int = 0, rank: int = 4,
           targets: str | list[str] = "all-linear", scheduler: bool = True
           ) -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel("ms://tiny")
    model.add_adapter_to_model("default", LoraConfig(r=rank, lora_alpha=8,
                                                     target_modules=targets),
                               gradient_accumulation_steps=accum, seed=seed)
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=lr)
    if scheduler:
        model.set_lr_scheduler("LinearLR", total_iters=4)
    return model


def _train_step(model: MultiLoraTransformersModel, batch) -> float:
    out = model.forward_backward(inputs=batch)
    model.clip_grad_norm(1.0)
    model.step()
    model.zero_grad()
    model.lr_step()
    return out.loss


# ----------------------------------------------------------------------------- the loop


@integration
def test_the_users_sft_loop_trains_and_lists_its_checkpoints(client):
    from twinkle_client.dataloader import DataLoader
    from twinkle_client.dataset import Dataset, DatasetMeta

    dataset = Dataset(dataset_meta=DatasetMeta("ms://swift/self-cognition", data_slice=range(16)))
    dataset.set_template("Template", model_id="ms://tiny", max_length=512)
    dataset.map("SelfCognitionProcessor", init_args={"model_name": "twinkle",
                                                     "model_author": "ModelScope"})
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=4)
    model = MultiLoraTransformersModel(model_id="ms://tiny")
    model.add_adapter_to_model("default", LoraConfig(target_modules="all-linear"),
                               gradient_accumulation_steps=2, seed=0)
    model.set_template("Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=3e-2)
    model.set_lr_scheduler("LinearLR")
    epoch_losses, saved, every = [], [], []
    for epoch in range(3):
        losses = []
        for batch in dataloader:
            losses.append(model.forward_backward(inputs=batch).loss)
            model.clip_grad_norm(1.0)
            model.step()
            model.zero_grad()
            model.lr_step()
        epoch_losses.append(float(np.mean(losses)))
        every += losses
        saved.append(model.save(name=f"twinkle-epoch-{epoch}", save_optimizer=True))
    assert epoch_losses[2] < epoch_losses[0] - 0.2, epoch_losses
    resume_path = None
    for run in client.list_training_runs():
        for ckpt in client.list_checkpoints(run.training_run_id):
            resume_path = ckpt.twinkle_path
    assert resume_path == saved[-1] == f"twinkle://{model.training_run_id}/weights/twinkle-epoch-2"
    configs = model.get_train_configs()
    assert configs["gradient_accumulation_steps"] == 2
    assert (configs["micro_step"], configs["step"]) == (12, 6)
    metrics = model.calculate_metric(is_training=True)  # averages since the start
    assert metrics["steps"] == 6 and metrics["loss"] == pytest.approx(np.mean(every), rel=1e-6)


@integration
def test_resume_with_optimizer_continues_to_the_weights_of_an_uninterrupted_run(client,
                                                                               tmp_path):
    batches = [toy_features(4, seed=s) for s in range(4)]
    straight = _model(seed=1)
    for batch in batches[:2]:
        _train_step(straight, batch)
    half = straight.save("half", save_optimizer=True)
    for batch in batches[2:]:
        _train_step(straight, batch)
    end = straight.save("end")
    resumed = _model(seed=2, lr=0.5, scheduler=False)  # all replaced by the checkpoint
    resumed.load(half, load_optimizer=True)
    assert resumed.get_train_configs()["optimizer"]["kwargs"]["lr"] == 1e-2
    for batch in batches[2:]:
        _train_step(resumed, batch)
    _assert_close(_weights(client, resumed.save("end"), tmp_path / "resumed"),
                  _weights(client, end, tmp_path / "straight"), atol=1e-6)
    # The bare name of a checkpoint of the model's own run works too.
    straight.load("half")


def test_save_overwrites_a_name_only_when_asked_and_keeps_the_old_one_otherwise(
        client, tmp_path):
    """A loop that re-saves 'latest' every few steps, as save_pretrained overwrites: once
    the native save had no `overwrite`, and the server's refusal told the user to use it."""
    model = _model(scheduler=False)
    first = model.save("latest")
    before = _weights(client, first, tmp_path / "before")
    _train_step(model, toy_features(4, seed=3))
    with pytest.raises(FailedPreconditionError, match="'latest' already exists; choose "
                                                      "another name or overwrite it"):
        model.save("latest")
    _assert_close(_weights(client, first, tmp_path / "kept"), before, atol=0.0)
    with pytest.raises(ValueError, match="overwrite: must be True or False"):
        model.save("latest", overwrite="yes")
    assert model.save("latest", save_optimizer=True, overwrite=True) == first
    after = _weights(client, first, tmp_path / "after")
    assert max(float(np.abs(after[k] - before[k]).max()) for k in after) > 0


@integration
def test_gradient_accumulation_of_two_equals_one_double_batch(client, tmp_path):
    accum = _model(accum=2, seed=7)
    double = _model(accum=1, seed=7)
    batches = [toy_features(4, seed=10 + s) for s in range(2)]
    # Same weights at the start: a training micro-batch reports its own token mean (not
    # halved by the accumulation), as a forward_only of the same batch does.
    first = accum.forward_backward(batches[0][:2]).loss
    assert first == pytest.approx(double.forward_only(batches[0][:2]).loss, rel=1e-6)
    assert accum.forward_only(batches[0][:2]).loss == pytest.approx(first, rel=1e-6)
    accum.clip_grad_and_step(1.0)
    assert accum.forward_backward(batches[0][2:]).loss > 0
    assert accum.clip_grad_and_step(1.0)["applied"] == 1.0
    _train_step(double, batches[0])
    for micro in (batches[1][:2], batches[1][2:]):
        _train_step(accum, micro)
    _train_step(double, batches[1])
    assert accum.get_train_configs()["step"] == double.get_train_configs()["step"] == 2
    # Two micro-batches against one batch of both: other pass shapes, so gradients a
    # rounding apart, which Adam may turn into a visible step (tests/numerics.py).
    assert_trained_alike(_weights(client, accum.save("a"), tmp_path / "a"),
                         _weights(client, double.save("d"), tmp_path / "d"),
                         learning_rate=1e-2, steps=2)


@integration
def test_two_models_in_one_process_train_independently_and_equal_their_solo_runs(client,
                                                                                  tmp_path):
    data = {1: [toy_features(3, seed=20 + s) for s in range(3)],
            2: [toy_features(5, length=9, seed=30 + s) for s in range(3)]}

    def build(which: int) -> MultiLoraTransformersModel:
        if which == 1:
            return _model(lr=1e-2, seed=1, rank=4)
        return _model(lr=3e-2, seed=2, rank=2, targets=["q_proj", "down_proj"])

    def train_blocking(model, batches) -> None:
        for batch in batches:
            _train_step(model, batch)

    def train_queued(model, batches) -> None:
        # Every op queued before any is awaited: seq ids keep call order.
        futures = []
        for batch in batches:
            futures.append(model.forward_backward(batch, blocking=False))
            futures.append(model.clip_grad_and_step(1.0, blocking=False))
        assert all(isinstance(f, Future) for f in futures)
        for fut in futures:
            fut.result()

    together = {1: build(1), 2: build(2)}
    threads = [threading.Thread(target=train_blocking, args=(together[1], data[1])),
               threading.Thread(target=train_queued, args=(together[2], data[2]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Whether the two models' passes merged depends on the threads' timing; merged or
    # not, each model's weights are its solo run's within Adam's drift (tests/numerics.py).
    for which, lr in ((1, 1e-2), (2, 3e-2)):
        solo = build(which)
        train_blocking(solo, data[which])
        assert_trained_alike(
            _weights(client, together[which].save(f"t{which}"), tmp_path / f"t{which}"),
            _weights(client, solo.save(f"s{which}"), tmp_path / f"s{which}"),
            learning_rate=lr, steps=3)


@integration
def test_one_model_object_holds_named_adapters_that_train_separately(client):
    model = MultiLoraTransformersModel("tiny")
    model.add_adapter_to_model("a", {"r": 2, "target_modules": "all-linear"}, seed=1)
    model.add_adapter_to_model("b", {"r": 2, "target_modules": "all-linear"}, seed=1)
    with pytest.raises(ValueError, match=r"adapter_name: the model holds \['a', 'b'\]"):
        model.set_loss("CrossEntropyLoss")
    with pytest.raises(ValueError, match="adapter_name: 'a' already exists"):
        model.add_adapter_to_model("a", {"r": 2, "target_modules": "all-linear"})
    for name in ("a", "b"):
        model.set_loss("CrossEntropyLoss", adapter_name=name)
        model.set_optimizer("SGD", lr=0.5, adapter_name=name)
    batch = toy_features(2)
    model.forward_backward(batch, adapter_name="a")
    model.clip_grad_and_step(adapter_name="a")
    after_a = model.forward_only(batch, adapter_name="a").loss
    assert after_a < model.forward_only(batch, adapter_name="b").loss
    assert model.calculate_loss(adapter_name="b") != after_a
    assert model.get_adapter_info("a").training_run_id != model.get_adapter_info("b").training_run_id
    model.remove_adapter("b")
    assert model.adapter_names == ["a"]


# ----------------------------------------------------------------------------- sampling / RL


@integration
def test_sampling_sees_earlier_training_and_rollouts_feed_grpo(client):
    model = _model(lr=5e-2, scheduler=False, rank=8)
    prompt = np.arange(5, 13)
    before = model.sample(prompt, max_tokens=6, temperature=0.0)
    target = np.array([40, 41, 42, 43, 44, 45])
    full = np.concatenate([prompt, target])
    labels = full[1:].copy()
    labels[:prompt.size - 1] = -100
    feature = {"input_ids": full[:-1], "labels": labels}
    futures = [model.forward_backward([feature], blocking=False)]
    for _ in range(15):
        futures.append(model.clip_grad_and_step(blocking=False))
        futures.append(model.forward_backward([feature], blocking=False))
    # Queued behind every training op above: it samples from the trained adapter.
    after = model.sample(prompt, max_tokens=6, temperature=0.0)
    assert set(after.sequences[0].tokens.tolist()) <= set(target.tolist())
    assert not set(before.sequences[0].tokens.tolist()) <= set(target.tolist())
    assert all(f.exception() is None for f in futures)

    rollout = model.sample([prompt, prompt], max_tokens=5, temperature=1.0, seed=3, num_samples=2)
    assert [s.prompt_index for s in rollout.sequences] == [0, 0, 1, 1]
    seq = rollout.sequences[0]
    fed = seq.new_input_feature
    assert fed["input_ids"].size == prompt.size + seq.tokens.size - 1
    assert (fed["labels"] != features.IGNORE_INDEX).sum() == seq.tokens.size
    model.set_loss("GRPOLoss", epsilon=0.2)
    out = model.forward_backward([s.new_input_feature for s in rollout.sequences],
                                 old_logps=[s.logprobs for s in rollout.sequences],
                                 advantages=[1.0, -1.0, 0.5, -0.5], micro_batch_size=2)
    # The sampler's logprobs are the trainer's: every ratio is 1 on the completion tokens.
    assert out.metrics["ratio:mean"] == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(ValueError, match=r"old_logps\[0\]: has 2 values"):
        model.forward_backward([fed], old_logps=[[0.0, 0.0]], advantages=[1.0])
    with pytest.raises(ValueError, match="advantages: has 1 entries but inputs hold 2"):
        model.forward_backward([fed, fed], advantages=[1.0])


# ----------------------------------------------------------------------------- errors


@integration
def test_an_unserved_model_id_is_an_error_naming_what_is_served(client):
    with pytest.raises(InvalidArgumentError, match=r"'ms://Qwen/Qwen3.5-4B' is not served .* "
                                                   r"\['tiny'\]"):
        MultiLoraTransformersModel(model_id="ms://Qwen/Qwen3.5-4B")


@integration
def test_rejected_calls_take_no_seq_id_and_server_errors_do_not_stall_later_ops(client):
    model = _model(scheduler=False)
    with pytest.raises(ProcessorError, match="attention_mask"):
        model.forward_backward({"input_ids": [[5, 6, 7]], "attention_mask": [[1, 0, 1]]})
    with pytest.raises(ProcessorError, match=r"inputs\[0\].labels: has 2 positions"):
        model.forward_backward([{"input_ids": [5, 6, 7], "labels": [6, 7]}])
    with pytest.raises(wire.WireError, match=r"feature\[0\].labels: must be integers"):
        model.forward_backward([{"input_ids": [5, 6, 7], "labels": [6.5, 7.0, 8.0]}])
    with pytest.raises(wire.WireError, match=r"datum\[1\].input_ids: token ids must be non-neg"):
        model.forward_backward([{"input_ids": [5, 6, 7], "labels": [6, 7, 8]},
                                {"input_ids": [5, -6, 7], "labels": [6, 7, 8]}])
    with pytest.raises(ValueError, match="save|name"):
        model.save("../escape")
    with pytest.raises(InvalidArgumentError, match="optimizer.betz: AdamW takes no argument"):
        model.set_optimizer("AdamW", betz=0.9)
    with pytest.raises(InvalidArgumentError, match="loss_fn: unknown loss 'Hinge'"):
        model.set_loss("Hinge")
    with pytest.raises(ValueError, match="save_optimizer: must be True or False, got 'yes'"):
        model.save("ck", save_optimizer="yes")
    with pytest.raises(ValueError, match="load_optimizer: must be True or False"):
        model.load("ck", load_optimizer=1)
    with pytest.raises(ValueError, match="is_training: must be True or False"):
        model.calculate_metric(is_training="no")
    padded = InputProcessor("left").collate(toy_features(2))
    assert model.forward_backward(padded).loss > 0  # the model's queue is not stuck
    with pytest.raises(ValueError, match="calculate_loss: no forward"):
        _model(scheduler=False).calculate_loss()


def test_a_negative_clip_cap_is_refused_inside_and_at_the_end_of_a_window(client):
    """Mid-window clip_grad_norm only measures, but a cap below 0 is refused there too:
    once it was silently read as "no clipping"."""
    model = _model(accum=2, scheduler=False)
    batch = InputProcessor("left").collate(toy_features(2))
    for _ in range(2):
        model.forward_backward(batch)
        with pytest.raises(InvalidArgumentError, match=r"max_norm: must be >= 0"):
            model.clip_grad_norm(-1.0)
    assert model.clip_grad_norm(1.0) > 0   # the window's gradients are all there


# ----------------------------------------------------------------------------- LoRA mapping


def test_a_peft_lora_config_maps_onto_the_wire_fields():
    spec = lora_spec(LoraConfig(r=16, lora_alpha=32, lora_dropout=0.1, use_rslora=True,
                                target_modules=["v_proj", "q_proj"]), seed=5)
    assert (spec.rank, spec.alpha, spec.use_rslora, spec.seed) == (16, 32.0, True, 5)
    assert spec.dropout == pytest.approx(0.1)
    assert list(spec.target_modules) == ["q_proj", "v_proj"] and not spec.all_linear
    default = lora_spec(LoraConfig(target_modules="all-linear"))
    assert default.all_linear and (default.rank, default.alpha) == (8, 8.0)
    assert default.seed is None
    assert lora_spec({"r": 2, "target_modules": "all-linear", "task_type": "CAUSAL_LM"}).rank == 2


@pytest.mark.parametrize("config, match", [
    (LoraConfig(target_modules="all-linear", use_dora=True), r"lora_config.use_dora: True is "
                                                             r"not supported"),
    (LoraConfig(target_modules="all-linear", bias="all"), r"lora_config.bias: 'all'"),
    (LoraConfig(target_modules="all-linear", modules_to_save=["lm_head"]),
     r"lora_config.modules_to_save"),
    (LoraConfig(target_modules="all-linear", init_lora_weights="gaussian"),
     r"lora_config.init_lora_weights"),
    (LoraConfig(target_modules=".*q_proj"), r"lora_config.target_modules: the regex"),
    (LoraConfig(), r"lora_config.target_modules: not set"),
    (LoraConfig(target_modules="all-linear", lora_alpha=0), r"lora_config.lora_alpha: must be > 0"),
    ({"rank": 4}, r"lora_config.rank: not a peft LoraConfig field"),
    ("r=4", r"lora_config: expected a peft.LoraConfig or a dict"),
])
def test_lora_fields_the_server_cannot_honour_are_refused_by_name(config, match):
    with pytest.raises(ValueError, match=match):
        lora_spec(config)
