"""Base model loading from the Hugging Face cache, offline: a hub id resolves only to files
already cached, and an id that is not cached is a clear error, never a download."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

_LOAD = textwrap.dedent("""
    import sys
    from twinkle_server.engine.base_model import load_base_model
    from twinkle_server.engine.errors import NotFound
    try:
        base = load_base_model(sys.argv[1], device="cpu")
    except NotFound as exc:
        print("NOT FOUND:", exc)
    else:
        print("LOADED", base.arch, base.vocab_size, base.model_dir)
""")


def _load_in_fresh_process(model_id: str, hub_cache) -> str:
    """huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE at import: a new process."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", _LOAD, model_id], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_hub_id_loads_from_the_local_cache_and_an_uncached_one_is_not_found(
        tiny_cache, tmp_path):
    from twinkle_server.engine.tiny_model import build_tiny_model

    source = build_tiny_model(tiny_cache)
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--twinkle-test--tiny-cached"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file() and not item.name.startswith("."):
            shutil.copy(item, snapshot / item.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)

    out = _load_in_fresh_process("twinkle-test/tiny-cached", tmp_path / "hub")
    assert out.startswith("LOADED Qwen3ForCausalLM 4096"), out
    assert str(snapshot) in out

    missing = _load_in_fresh_process("twinkle-test/not-cached", tmp_path / "hub")
    assert missing.startswith("NOT FOUND: model: 'twinkle-test/not-cached' is neither a built-in "
                              "('tiny', 'tiny-large')"), \
        missing
    assert "downloads a hub id at start" in missing     # loading never downloads


def test_a_multimodal_configs_context_and_eos_come_from_its_text_model(tiny_cache):
    """Gemma 3's multimodal config keeps `max_position_embeddings` and `eos_token_id` in
    its text config: the context once fell back to 4,096 without a word, and the EOS
    ids raised AttributeError."""
    from pathlib import Path

    import torch
    from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration

    from twinkle_server.engine.base_model import BaseModel
    from twinkle_server.engine.tiny_model import build_tiny_model

    config = Gemma3Config(
        text_config=dict(vocab_size=4096, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=256, sliding_window=16,
                         eos_token_id=7),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4)
    assert not hasattr(config, "max_position_embeddings")
    tiny = build_tiny_model(tiny_cache)
    base = BaseModel(Gemma3ForConditionalGeneration(config), AutoTokenizer.from_pretrained(tiny),
                     "gemma3-mm", Path(tiny), torch.device("cpu"), torch.float32)
    assert base.max_seq_len == 256
    assert 7 in base.eos_token_ids
