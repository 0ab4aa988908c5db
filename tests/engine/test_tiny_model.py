"""The embedded tiny model: deterministic bytes, loadable offline, ChatML template, cache."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from twinkle_server.engine import tiny_model
from twinkle_server.engine.errors import FailedPrecondition
from twinkle_server.engine.tiny_model import (
    ADDED_TOKENS,
    FAMILY_SPECIAL_TOKENS,
    IM_END,
    IM_START,
    PAD_TOKEN,
    QWEN_TAGS,
    SPECIAL_TOKENS,
    TINY_LARGE_NAME,
    TINY_MODEL_NAME,
    build_tiny_model,
    recipe_hash,
)

TWO_TURNS = [
    {"role": "user", "content": "Who are you?"},
    {"role": "assistant", "content": "I am Twinkle."},
]


def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-cache"))


@pytest.fixture(scope="module")
def tokenizer(built):
    return AutoTokenizer.from_pretrained(built)


def test_two_builds_in_different_cache_dirs_give_byte_identical_files(tmp_path):
    first = build_tiny_model(tmp_path / "a")
    second = build_tiny_model(tmp_path / "b")
    assert first.name == second.name == f"tiny-qwen3-{recipe_hash()}"
    files = _files(first)
    assert files == _files(second)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(files)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        text = files[name].decode()
        assert "transformers_version" not in text
        assert text == json.dumps(json.loads(text), sort_keys=True, indent=1,
                                  ensure_ascii=False) + "\n"


def test_config_is_the_small_untied_float32_qwen3_of_the_recipe(built):
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (
        128, 4, 4, 2, 32, 384)
    assert config["vocab_size"] == 4096
    assert config["max_position_embeddings"] == 4096
    assert config["tie_word_embeddings"] is False
    assert config["dtype"] == "float32"


def test_loads_offline_with_auto_classes_and_forward_gives_vocab_logits(built, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads HF_HUB_OFFLINE at import, so the env alone proves little here:
    # refuse every connection, and any attempt to reach a hub fails the test.

    def no_network(*args, **kwargs):
        raise AssertionError(f"tiny model load tried to open a connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    model = AutoModelForCausalLM.from_pretrained(built)
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert model.dtype == torch.float32
    assert model.get_input_embeddings().weight.data_ptr() != (
        model.get_output_embeddings().weight.data_ptr())
    ids = tokenizer("Who are you?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 4096)
    assert torch.isfinite(logits).all()
    assert len(tokenizer) == model.config.vocab_size == 4096


def test_chat_template_renders_two_turns_as_chatml_exactly(tokenizer):
    assert tokenizer.apply_chat_template(TWO_TURNS, tokenize=False) == (
        "<|im_start|>user\nWho are you?<|im_end|>\n"
        "<|im_start|>assistant\nI am Twinkle.<|im_end|>\n"
    )


def test_add_generation_prompt_appends_the_assistant_header(tokenizer):
    prompt = tokenizer.apply_chat_template(TWO_TURNS[:1], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWho are you?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template(TWO_TURNS[:1], add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)
    assert tokenizer.decode(ids) == prompt


@pytest.mark.parametrize("text", [
    "héllo wörld ✨ 日本語 — Привет, ¿qué tal? 🙂",
    "12 + 35 = 47\n#### 47",
    "-521 0.25 3.14159 1,000,000 $65 100%",
    "  spaced\ttabs\n\nand blank lines  ",
    "",
])
def test_tokenizer_round_trips_unicode_and_numbers(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_and_survive_inside_text(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS]
    assert ids == [0, 1, 2]
    for token, token_id in zip(SPECIAL_TOKENS, ids, strict=True):
        assert tokenizer(token)["input_ids"] == [token_id]
    encoded = tokenizer(f"{IM_START}user\nhi{IM_END}\n")["input_ids"]
    assert encoded[0] == 1 and encoded.count(2) == 1
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "user\nhi\n"
    assert tokenizer.bos_token is None  # nothing is prepended to encoded text


# What tinker-cookbook 0.6.1's renderers look up or assert is one token (renderers/qwen3.py,
# qwen3_5.py `_normalize_response_tokens`, llama3.py `_bos_tokens`/`_end_message_token`,
# gpt_oss.py `_return_token`/`_call_token` and the Harmony headers). cookbook-check's
# `renderers` part runs the renderers themselves on the tiny tokenizer.
RENDERER_TOKENS = (
    "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<|vision_start|>", "<|vision_end|>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
    "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|end|>", "<|return|>",
    "<|call|>",
)


def test_every_renderer_token_of_the_cookbook_families_encodes_to_one_id(tokenizer):
    assert set(RENDERER_TOKENS) <= set(ADDED_TOKENS)
    ids = [tokenizer.encode(token, add_special_tokens=False) for token in ADDED_TOKENS]
    assert all(len(one) == 1 for one in ids), dict(zip(ADDED_TOKENS, ids, strict=True))
    flat = [one[0] for one in ids]
    extra = len(ADDED_TOKENS) - len(SPECIAL_TOKENS)
    # pad/im_start/im_end keep ids 0, 1, 2; the family tokens take the vocabulary's last ids.
    assert flat == [0, 1, 2, *range(4096 - extra, 4096)]
    assert tokenizer.convert_ids_to_tokens(flat) == list(ADDED_TOKENS)


def test_family_tokens_survive_inside_text_and_qwen_tags_survive_skipping_specials(
        tokenizer):
    think_open, think_close = (tokenizer.convert_tokens_to_ids(t) for t in QWEN_TAGS[:2])
    # Qwen3.5's prompt prefill and a sampled reply: `</think>` is one id inside text.
    encoded = tokenizer.encode("<think>\nstep</think>\n\n4<|im_end|>", add_special_tokens=False)
    assert encoded[0] == think_open and encoded.count(think_close) == 1
    assert tokenizer.decode(encoded) == "<think>\nstep</think>\n\n4<|im_end|>"
    # As in Qwen3: the think/tool tags are not special (the renderers parse them from decoded
    # text); the other families' control tokens are, like <|im_end|>.
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "<think>\nstep</think>\n\n4"
    harmony = "<|start|>assistant<|channel|>final<|message|>hi<|return|>"
    ids = tokenizer.encode(harmony, add_special_tokens=False)
    assert sum(tokenizer.convert_ids_to_tokens(i) in FAMILY_SPECIAL_TOKENS for i in ids) == 4
    assert tokenizer.decode(ids) == harmony
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistantfinalhi"


def test_config_eos_and_pad_ids_match_the_tokenizer(built, tokenizer):
    config = json.loads((built / "config.json").read_text())
    generation = json.loads((built / "generation_config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    pad = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == PAD_TOKEN
    assert config["eos_token_id"] == generation["eos_token_id"] == im_end
    assert config["pad_token_id"] == generation["pad_token_id"] == pad


def test_second_call_with_same_cache_dir_returns_cached_dir_without_rebuilding(
        tmp_path, monkeypatch):
    path = build_tiny_model(tmp_path)
    before = {p.name: os.stat(p).st_mtime_ns for p in path.iterdir()}

    def fail_if_rebuilt(out):
        raise AssertionError("a complete cached model was rebuilt")

    monkeypatch.setattr(tiny_model, "_write_model", fail_if_rebuilt)
    assert build_tiny_model(tmp_path) == path
    assert {p.name: os.stat(p).st_mtime_ns for p in path.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_default_location_is_under_twinkle_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TWINKLE_CACHE_DIR", str(tmp_path / "env-cache"))
    path = build_tiny_model()
    assert path == tmp_path / "env-cache" / f"tiny-qwen3-{recipe_hash()}"
    assert TINY_MODEL_NAME == "tiny"


def test_builder_that_loses_the_rename_race_returns_the_winners_dir(tmp_path, monkeypatch):
    real_write = tiny_model._write_model
    winner = {}

    def concurrent_winner_finishes_first(out, recipe):
        # Another builder completes and renames into place while this one is still writing.
        monkeypatch.setattr(tiny_model, "_write_model", real_write)
        winner["path"] = build_tiny_model(tmp_path)
        winner["mtime"] = os.stat(winner["path"] / "model.safetensors").st_mtime_ns
        real_write(out, recipe)

    monkeypatch.setattr(tiny_model, "_write_model", concurrent_winner_finishes_first)
    path = build_tiny_model(tmp_path)
    assert path == winner["path"]
    assert os.stat(path / "model.safetensors").st_mtime_ns == winner["mtime"]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # loser's scratch removed


def test_incomplete_dir_at_the_target_raises_failed_precondition(tmp_path):
    (tmp_path / f"tiny-qwen3-{recipe_hash()}").mkdir()
    with pytest.raises(FailedPrecondition, match="cache_dir: .*not a complete"):
        build_tiny_model(tmp_path)


def test_building_does_not_move_the_callers_torch_random_stream(tmp_path):
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    build_tiny_model(tmp_path)
    assert torch.equal(torch.rand(3), expected)


def test_tiny_large_shares_the_tokenizer_and_has_its_own_shape(tmp_path):
    """The second built-in base: a teacher or grader for `tiny` (same ids), not a copy."""
    small = build_tiny_model(tmp_path)
    large = build_tiny_model(tmp_path, TINY_LARGE_NAME)
    assert small != large
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (small / name).read_bytes() == (large / name).read_bytes()
    config = json.loads((large / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        192, 6, 4096)
