"""The embedded tiny model: deterministic bytes, loadable offline, ChatML template."""

from __future__ import annotations

import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle_server.engine.tiny_model import IM_END, SPECIAL_TOKENS, build_tiny_model


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_two_builds_give_byte_identical_files(tmp_path):
    first = build_tiny_model(tmp_path / "a")
    second = build_tiny_model(tmp_path / "b")
    assert first.name == second.name
    assert _files(first) == _files(second)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_files(first))


def test_loads_offline_with_auto_classes_and_runs_forward(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = build_tiny_model(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer("Who are you?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert model.config.vocab_size == len(tokenizer)


def test_chat_template_renders_chatml(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path))
    messages = [{"role": "user", "content": "Who are you?"},
                {"role": "assistant", "content": "I am Twinkle."}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\nI am Twinkle.<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_round_trips_text_and_special_tokens_are_single_ids(tmp_path):
    path = build_tiny_model(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for text in ["héllo wörld ✨ 日本", "12 + 35 = 47\n#### 47", "  spaced\ttabs"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    for token in SPECIAL_TOKENS:
        assert len(tokenizer(token)["input_ids"]) == 1
    config = AutoModelForCausalLM.from_pretrained(path).config
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)


def test_second_call_returns_the_cached_directory_without_rebuilding(tmp_path):
    path = build_tiny_model(tmp_path)
    mtime = os.stat(path / "model.safetensors").st_mtime_ns
    start = time.perf_counter()
    assert build_tiny_model(tmp_path) == path
    assert time.perf_counter() - start < 0.5
    assert os.stat(path / "model.safetensors").st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
