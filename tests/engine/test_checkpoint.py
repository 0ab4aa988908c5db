"""PEFT-format checkpoints: what peft writes, what peft loads, exact resume, refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from twinkle_server.engine import checkpoint
from twinkle_server.engine.adapter_import import base_linears, read_import
from twinkle_server.engine.engine import Engine, ForwardRequest, SampleRequest
from twinkle_server.engine.errors import FailedPrecondition, InvalidArgument, NotFound
from twinkle_server.engine.types import (
    AdamParams,
    EngineLimits,
    LoraSpec,
    LossSpec,
    SamplingParams,
)

from ..numerics import LOGPROB_ATOL
from .conftest import adapter_weights
from .draws import assert_sampled_alike, sampled_alone
from .families import (
    MULTIMODAL,
    next_token_datums,
    skip_unchecked_mixers,
    skip_unserved_experts,
    write_multimodal,
)

CE = LossSpec("cross_entropy")


def peft_model(engine, path, trainable: bool = False):
    """The base reloaded from disk with a saved adapter, as any PEFT user would load it."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(engine.base.model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(path), is_trainable=trainable)


def peft_logprobs(model, datum) -> torch.Tensor:
    ids = torch.from_numpy(datum.input_ids)[None]
    logits = model(input_ids=ids).logits[0].float()
    targets = torch.from_numpy(datum.loss_inputs["target_tokens"])
    return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")
ADAM = AdamParams(learning_rate=5e-3, eps=1e-8, weight_decay=0.01)


def _train(engine, name, datums, steps):
    for _ in range(steps):
        engine.forward_batch([ForwardRequest(name, datums[:3], CE, True)])
        engine.optim_step(name, ADAM)


def _native(engine, name, datums, steps):
    """`steps` micro-steps of the native loop: forward_backward, step, zero_grad, lr_step."""
    for _ in range(steps):
        engine.forward_batch([ForwardRequest(name, datums[:2], None, True)])
        engine.step(name)
        engine.zero_grad(name)
        engine.lr_step(name)


def test_files_have_the_keys_shapes_and_config_peft_itself_writes(engine, add, tmp_path):
    spec = LoraSpec(rank=4, alpha=8, dropout=0.1, target_modules=("q_proj", "down_proj"),
                    seed=1)
    add("fmt", spec)
    written = engine.save_weights("fmt", tmp_path / "ours")
    base = AutoModelForCausalLM.from_pretrained(engine.base.model_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                    target_modules=["q_proj", "down_proj"])
                   ).save_pretrained(str(tmp_path / "peft"))
    ours = load_file(str(tmp_path / "ours" / "adapter_model.safetensors"))
    theirs = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in ours
    config = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["lora_dropout"],
            config["use_rslora"]) == ("LORA", 4, 8, 0.1, False)
    assert config["base_model_name_or_path"] == str(engine.base.model_dir)
    assert written == sum(f.stat().st_size for f in (tmp_path / "ours").iterdir())
    spec_back = engine.read_checkpoint_spec(tmp_path / "ours")
    assert (spec_back.rank, spec_back.alpha, spec_back.dropout) == (4, 8.0, 0.1)


def test_saving_the_same_adapter_again_writes_the_same_bytes(engine, add, tmp_path):
    """safetensors writes its metadata from a hash map whose order changes with every
    call: with more than one key (a Tinker run's role targets, a multimodal base's names),
    two saves of the same weights once differed (an encrypted export did not decrypt to
    the plain one's bytes). The header is written in one order."""
    add("again", LoraSpec.from_tinker(4, seed=3))
    files = []
    for n in range(8):
        engine.save_weights("again", tmp_path / str(n))
        files.append((tmp_path / str(n) / checkpoint.WEIGHTS_FILE).read_bytes())
    assert checkpoint.ROLES_METADATA.encode() in files[0]
    assert all(f == files[0] for f in files)


def test_saved_adapter_gives_the_engines_logits_in_peft(engine, datums, add, tmp_path):
    add("export", LoraSpec.from_tinker(rank=8, seed=9))  # attention, MLP and lm_head
    _train(engine, "export", datums, 2)
    engine.save_weights("export", tmp_path / "export")
    model = peft_model(engine, tmp_path / "export", trainable=False).eval()
    ours = engine.forward_batch([ForwardRequest("export", datums[:2], CE, False)])[0]
    with torch.no_grad():
        for index in range(2):
            theirs = peft_logprobs(model, datums[index]).numpy()
            np.testing.assert_allclose(ours.logprobs[index], theirs, atol=1e-5)


def test_load_state_with_optimizer_resumes_to_the_uninterrupted_weights(
        engine, datums, add, snapshot, diff, tmp_path):
    spec = LoraSpec(rank=4, alpha=8, seed=21)
    add("straight", spec)
    add("first", spec)
    _train(engine, "straight", datums, 4)
    _train(engine, "first", datums, 2)
    engine.save_state("first", tmp_path / "mid", include_optimizer=True)
    add("resumed", engine.read_checkpoint_spec(tmp_path / "mid"))
    engine.load_state("resumed", tmp_path / "mid", include_optimizer=True)
    _train(engine, "resumed", datums, 2)
    assert engine.adapters["resumed"].step == 4
    assert diff(snapshot("straight"), snapshot("resumed")) <= 1e-6


def test_a_weights_only_load_starts_the_optimizer_afresh_as_a_new_client_would(
        engine, datums, add, snapshot, diff, tmp_path):
    """The SDK's `load_state` loads "weights only, optimizer resets". A run that had
    stepped kept its Adam moments and step count through such a load, so it stepped
    differently from a new client loading the same weights. Same shapes and code path on
    both sides: only float noise (1e-6, as the resume tests) may differ."""
    spec = LoraSpec(rank=4, alpha=8, seed=5)
    add("source", spec)
    _train(engine, "source", datums, 1)
    engine.save_state("source", tmp_path / "w", include_optimizer=False)
    add("busy", spec)
    _train(engine, "busy", datums, 3)
    engine.load_state("busy", tmp_path / "w", include_optimizer=False)
    add("new", spec)
    engine.load_state("new", tmp_path / "w", include_optimizer=False)
    assert engine.adapters["busy"].step == 0
    _train(engine, "busy", datums, 2)
    _train(engine, "new", datums, 2)
    assert diff(snapshot("busy"), snapshot("new")) <= 1e-6


def test_a_weights_only_load_keeps_the_native_settings_and_restarts_their_state(
        engine, datums, add, snapshot, diff, tmp_path):
    """The native loop's optimizer, scheduler and loss stay set; the moments, the
    schedule's position and the counters start again, as in a new adapter set up alike."""
    spec = LoraSpec(rank=2, alpha=4, seed=3)
    add("source", spec)
    engine.save_state("source", tmp_path / "w", include_optimizer=False)

    for name in ("busy", "new"):
        add(name, spec)
        engine.set_loss(name, LossSpec("CrossEntropyLoss"))
        engine.set_optimizer(name, "AdamW", {"lr": 1e-2})
        engine.set_lr_scheduler(name, "CosineAnnealingLR", {"T_max": 4})
    _native(engine, "busy", datums, 3)
    for name in ("busy", "new"):
        engine.load_state(name, tmp_path / "w", include_optimizer=False)
    busy = engine.get_train_configs("busy")
    assert (busy["step"], busy["micro_step"]) == (0, 0)
    assert busy["optimizer"] == {"name": "AdamW", "kwargs": {"lr": 1e-2}}
    assert engine.adapters["busy"].learning_rate() == engine.adapters["new"].learning_rate()
    _native(engine, "busy", datums, 2)
    _native(engine, "new", datums, 2)
    assert diff(snapshot("busy"), snapshot("new")) <= 1e-6


def test_native_optimizer_scheduler_counters_and_a_windows_gradients_survive_a_save_and_load(
        engine, datums, add, snapshot, diff, tmp_path):
    spec = LoraSpec(rank=2, alpha=4, seed=2)

    for name in ("a", "b"):
        add(name, spec, gradient_accumulation_steps=2)
        engine.set_loss(name, LossSpec("CrossEntropyLoss"))
        engine.set_optimizer(name, "AdamW", {"lr": 1e-2})
        engine.set_lr_scheduler(name, "CosineAnnealingLR", {"T_max": 4})
    _native(engine, "a", datums, 6)
    # b stops mid accumulation window: its gradient so far is saved too.
    _native(engine, "b", datums, 3)
    engine.save_state("b", tmp_path / "b", include_optimizer=True)
    add("c", spec)
    engine.load_state("c", tmp_path / "b", include_optimizer=True, adopt_accumulation=True)
    configs = engine.get_train_configs("c")
    json.dumps(configs)
    assert configs["lr_scheduler"]["name"] == "CosineAnnealingLR"
    assert (configs["gradient_accumulation_steps"], configs["micro_step"]) == (2, 3)
    assert engine.adapters["c"].learning_rate() == engine.adapters["b"].learning_rate()
    # c finishes the window with the saved gradient and this micro-batch's.
    _native(engine, "c", datums, 1)
    _native(engine, "b", datums, 1)
    assert diff(snapshot("b"), snapshot("c")) <= 1e-6
    assert engine.adapters["c"].step == engine.adapters["b"].step == 2


def test_an_existing_target_is_never_overwritten_and_no_temp_dir_is_left(engine, add,
                                                                         tmp_path):
    add("once", LoraSpec(rank=2, alpha=2, seed=1))
    engine.save_weights("once", tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(FailedPrecondition, match="'ckpt' already exists"):
        engine.save_state("once", tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter_model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_loading_a_checkpoint_of_another_shape_or_without_state_is_refused(engine, add,
                                                                           tmp_path):
    add("r2", LoraSpec(rank=2, alpha=2, seed=1))
    add("r4", LoraSpec(rank=4, alpha=2, seed=1))
    add("mlp", LoraSpec(rank=2, alpha=2, seed=1, target_modules=("up_proj",)))
    engine.save_weights("r2", tmp_path / "r2")
    engine.save_weights("mlp", tmp_path / "mlp")
    with pytest.raises(InvalidArgument, match=r"has shape \[2, \d+\], the adapter needs \[4"):
        engine.load_state("r4", tmp_path / "r2", include_optimizer=False)
    with pytest.raises(InvalidArgument, match=r"has \d+ tensors the adapter does not"):
        engine.load_state("mlp", tmp_path / "r2", include_optimizer=False)
    with pytest.raises(InvalidArgument, match=r"lacks 48 tensors, e.g. .*down_proj"):
        engine.load_state("r2", tmp_path / "mlp", include_optimizer=False)
    with pytest.raises(FailedPrecondition, match="without optimizer state"):
        engine.load_state("r2", tmp_path / "r2", include_optimizer=True)
    with pytest.raises(NotFound, match="no adapter_config.json"):
        engine.read_checkpoint_spec(tmp_path / "missing")


def test_sampling_from_saved_weights_equals_sampling_the_live_adapter(engine, datums, add,
                                                                      tmp_path):
    add("live", LoraSpec.from_tinker(rank=4, seed=3))
    _train(engine, "live", datums, 2)
    engine.save_weights("live", tmp_path / "sampler")
    params = SamplingParams(max_tokens=6, seed=5, ignore_eos=True)
    prompt = datums[0].input_ids[:4]
    alone = SampleRequest("live", None, prompt, 1, params)
    reference = sampled_alone(lambda: engine.sample_batch([alone])[0], params)
    live, saved = engine.sample_batch([
        alone, SampleRequest(None, str(tmp_path / "sampler"), prompt, 1, params)])
    # Bit-identical weights (safetensors keeps float32 as is), but two rows of a batch
    # against one alone, which may round apart: each the live adapter's tokens up to a
    # near tie (`draws.assert_sampled_alike`).
    assert_sampled_alike(reference, live)
    assert_sampled_alike(reference, saved)
    np.testing.assert_allclose(
        engine.compute_logprobs(None, str(tmp_path / "sampler"), datums[1].input_ids),
        engine.compute_logprobs("live", None, datums[1].input_ids), atol=1e-5)


def test_loading_state_with_another_accumulation_count_is_refused_before_anything_changes(
        engine, add, datums, tmp_path, snapshot, diff):
    spec = LoraSpec.from_tinker(rank=4, seed=7)
    add("acc1", spec)
    engine.set_loss("acc1", LossSpec("CrossEntropyLoss"))
    engine.set_optimizer("acc1", "AdamW", {"lr": 1e-3})
    for _ in range(3):
        engine.forward_batch([ForwardRequest("acc1", datums[:2], None, True)])
        engine.step("acc1")
        engine.zero_grad("acc1")
    engine.save_state("acc1", tmp_path / "acc1", include_optimizer=True)
    add("acc4", spec, gradient_accumulation_steps=4)
    engine.set_optimizer("acc4", "SGD", {"lr": 1e-2})
    before = snapshot("acc4")
    with pytest.raises(FailedPrecondition, match="saved with gradient_accumulation_steps=1 "
                                                 "but this adapter uses 4"):
        engine.load_state("acc4", tmp_path / "acc1", include_optimizer=True)
    assert diff(snapshot("acc4"), before) == 0.0  # refused before anything ran: exact
    configs = engine.get_train_configs("acc4")
    assert (configs["gradient_accumulation_steps"], configs["optimizer"]["name"]) == (4, "SGD")
    engine.load_state("acc4", tmp_path / "acc1", include_optimizer=False)  # weights only: fine
    assert diff(snapshot("acc4"), snapshot("acc1")) == 0.0  # a float32 copy: exact


def test_loading_a_state_saved_without_an_optimizer_clears_the_optimizer_and_its_name(
        engine, add, tmp_path):
    spec = LoraSpec.from_tinker(rank=4, seed=8)
    add("bare", spec)
    engine.save_state("bare", tmp_path / "bare", include_optimizer=True)
    add("configured", spec)
    engine.set_optimizer("configured", "AdamW", {"lr": 1e-3})
    engine.set_lr_scheduler("configured", "LinearLR", {})
    engine.load_state("configured", tmp_path / "bare", include_optimizer=True)
    configs = engine.get_train_configs("configured")
    assert configs["optimizer"]["name"] == "" and configs["lr_scheduler"]["name"] == ""
    with pytest.raises(FailedPrecondition, match="no optimizer"):
        engine.step("configured")


def test_sampling_from_weights_saved_over_a_loaded_checkpoint_uses_the_new_weights(
        engine, datums, add, tmp_path):
    add("over", LoraSpec(rank=4, alpha=8, seed=5))
    path = tmp_path / "sampler"
    tokens = np.asarray(datums[0].input_ids)
    engine.save_weights("over", path)
    first = engine.compute_logprobs(None, str(path), tokens)
    engine.forward_batch([ForwardRequest("over", datums[:4], CE, True)])
    engine.optim_step("over", AdamParams(learning_rate=1e-2))
    engine.save_weights("over", path, overwrite=True)
    second = engine.compute_logprobs(None, str(path), tokens)
    live = engine.compute_logprobs("over", None, tokens)
    assert not np.allclose(first[1:], second[1:])
    # Exact: one sequence each, the same shapes and code (a sampler checkpoint is a frozen
    # adapter of the same layers, its float32 weights copied in).
    np.testing.assert_array_equal(second, live)


def test_a_decode_batch_routing_more_checkpoints_than_the_cache_holds_samples_each_own(
        engine, datums, add, tmp_path, monkeypatch):
    # Three sampler checkpoints in one batch with room for two cached: evicting the first
    # while loading the third would leave its rows on the bare base model.
    monkeypatch.setattr(engine.sampling.samplers, "size", 2)
    params = SamplingParams(max_tokens=6, seed=5, ignore_eos=True)
    prompt = datums[0].input_ids[:4]
    paths = []
    for i in range(3):
        add(f"many{i}", LoraSpec(rank=4, alpha=8, seed=20 + i))
        _train(engine, f"many{i}", datums, 1)
        paths.append(str(tmp_path / f"sampler{i}"))
        engine.save_weights(f"many{i}", paths[-1])
    together = engine.sample_batch([SampleRequest(None, p, prompt, 1, params) for p in paths])
    for i, got in enumerate(together):
        live = SampleRequest(f"many{i}", None, prompt, 1, params)
        # 3 rows against 1: the live adapter's tokens up to a near tie, logprobs within
        # LOGPROB_ATOL (`draws.assert_sampled_alike`).
        assert_sampled_alike(sampled_alone(lambda r=live: engine.sample_batch([r])[0],
                                           params), got)
    assert len(engine.sampler_dirs()) == 2  # trimmed to the cache's size by the next call


# ------------------------------------------------- a multimodal checkpoint's text model
# Real Qwen3.5 checkpoints declare `Qwen3_5ForConditionalGeneration` (text weights under
# `model.language_model.`); the engine trains the text model AutoModelForCausalLM loads
# (`Qwen3_5ForCausalLM`, `model.layers.`). peft places an adapter by module name and
# does not translate between the two trees: an export in the text tree's names wrapped
# only lm_head on the declared class, silently (logprobs off by 1.02; 1.20 for MoE).


@pytest.fixture(scope="module", params=sorted(MULTIMODAL))
def multimodal(request, tiny_cache, tmp_path_factory) -> Engine:
    """The engine on a tiny multimodal checkpoint of the family, with adapter "mm":
    Tinker's default LoRA (attention, DeltaNet, MLP or experts, lm_head) trained 2 steps."""
    skip_unchecked_mixers(request.param)
    path = write_multimodal(tmp_path_factory.mktemp("multimodal"), request.param,
                            tiny_cache)
    engine = skip_unserved_experts(Engine.load(
        str(path), cache_dir=str(tiny_cache), samples=False,
        limits=EngineLimits(max_adapters=4, max_rank=16, max_seq_len=64,
                            max_batch_tokens=1024)))
    engine.add_adapter("mm", LoraSpec.from_tinker(8, seed=1))
    datums = next_token_datums(engine, ["Hello! I am Twinkle, a helpful assistant.",
                                        "Question: 12 + 30 = ? Answer: 42. #### 42"])
    _train(engine, "mm", datums, 2)
    return engine


def _declared(engine: Engine) -> torch.nn.Module:
    """The base as its checkpoint declares itself (config.json `architectures`)."""
    import transformers

    arch = json.loads((engine.base.model_dir / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(engine.base.model_dir,
                                                       dtype=torch.float32)


def test_a_multimodal_checkpoints_export_loads_in_peft_on_its_declared_architecture(
        multimodal, tmp_path):
    from peft import PeftModel

    engine = multimodal
    datums = next_token_datums(engine, ["You can call me Twinkle."])
    ours = engine.forward_batch([ForwardRequest("mm", datums, CE, False)])[0].logprobs
    engine.save_weights("mm", tmp_path / "export")
    model = PeftModel.from_pretrained(_declared(engine), str(tmp_path / "export")).eval()
    wrapped = [n for n, m in model.named_modules() if getattr(m, "lora_A", None)]
    assert len(wrapped) == len(engine.adapters["mm"].weights), wrapped
    assert not any(".visual." in n for n in wrapped)
    # The engine and peft compute the same LoRA by different code: LOGPROB_ATOL
    # (tests/numerics.py), as every family's export (tests/engine/test_families.py).
    with torch.no_grad():
        for datum, got in zip(datums, ours, strict=True):
            np.testing.assert_allclose(got, peft_logprobs(model, datum).numpy(), rtol=0,
                                       atol=LOGPROB_ATOL)


def test_a_multimodal_checkpoints_export_loads_back_into_the_engine_identically(
        multimodal, tmp_path):
    engine = multimodal
    want = adapter_weights(engine, "mm")
    engine.save_state("mm", tmp_path / "state")
    engine.save_weights("mm", tmp_path / "export")
    # Created from the checkpoint, as a client's create-from-state: its spec, its state.
    spec = engine.read_checkpoint_spec(tmp_path / "state")
    engine.add_adapter("again", spec)
    try:
        engine.load_state("again", tmp_path / "state", include_optimizer=True,
                          adopt_accumulation=True)
        got = adapter_weights(engine, "again")
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)
        # Loaded into the live adapter: the same weights (the files were read, not skipped).
        engine.load_state("mm", tmp_path / "export", include_optimizer=False)
        assert all(torch.equal(adapter_weights(engine, "mm")[k], want[k]) for k in want)
    finally:
        engine.remove_adapter("again")
    # Imported as an upload: the same linears and experts, the same matrices.
    imported = read_import(tmp_path / "export", base_linears(engine.base.model_dir),
                           max_rank=16, max_bytes=1 << 26)
    weights = engine.adapters["mm"].weights
    assert sorted(imported.modules) == sorted(n for n in weights if n in engine.layers)
    exported = checkpoint.read_weights(tmp_path / "export")
    assert imported.tensors.keys() == exported.keys()
    assert all(torch.equal(imported.tensors[k], exported[k]) for k in exported)


def test_an_adapter_peft_made_on_the_declared_multimodal_architecture_imports(
        multimodal, tmp_path):
    from peft import get_peft_model

    engine = multimodal
    model = get_peft_model(_declared(engine), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "in_proj_qkv"]))
    model.save_pretrained(str(tmp_path / "peft"))
    imported = read_import(tmp_path / "peft", base_linears(engine.base.model_dir),
                           max_rank=16, max_bytes=1 << 26)
    assert imported.modules and all(m in engine.layers for m in imported.modules)
    assert {m.rsplit(".", 1)[-1] for m in imported.modules} == {"q_proj", "in_proj_qkv"}
