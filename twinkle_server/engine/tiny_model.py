"""The embedded `tiny` base model: a small Qwen3 causal LM built offline, deterministically.

Tests and the demo use it instead of a hub model. The recipe below (architecture, seed,
tokenizer settings) and the shipped corpus `tiny_corpus.txt` fully determine the output:
the same code gives byte-identical files (config, safetensors weights, tokenizer), cached
in a directory named by a hash of that recipe, so a changed recipe never reuses stale files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

TINY_MODEL_NAME = "tiny"

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# Qwen3 architecture, about 1.1M parameters: small enough that a CPU test trains it in seconds.
RECIPE: dict[str, object] = {
    "max_vocab_size": 2048,  # BPE trainer cap; the shipped corpus yields fewer tokens
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "init_seed": 1234,
    "format": 1,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = Path(__file__).with_name("tiny_corpus.txt")
_DONE_MARKER = ".complete"


def recipe_hash() -> str:
    """Short hash of everything that determines the files: recipe, template and corpus."""
    digest = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode())
    digest.update(CHAT_TEMPLATE.encode())
    digest.update(_CORPUS.read_bytes())
    return digest.hexdigest()[:12]


def default_cache_root() -> Path:
    env = os.environ.get("TWINKLE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "twinkle"


def build_tiny_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory of the tiny model, building it first if it is not cached.

    Safe to call from several processes at once: each builds into its own temp dir and
    renames it into place; a process that loses the race uses the winner's directory.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / f"tiny-qwen3-{recipe_hash()}"
    if (target / _DONE_MARKER).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=root))
    try:
        _write_model(scratch)
        (scratch / _DONE_MARKER).write_text("")
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / _DONE_MARKER).exists():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(RECIPE["max_vocab_size"]),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.read_text().splitlines(), trainer=trainer)
    return tokenizer


def _write_model(out: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    raw = _train_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, pad_token=PAD_TOKEN, eos_token=IM_END,
        additional_special_tokens=[IM_START], model_max_length=int(RECIPE["max_position_embeddings"]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    config = Qwen3Config(
        vocab_size=raw.get_vocab_size(),
        hidden_size=RECIPE["hidden_size"],
        num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        num_key_value_heads=RECIPE["num_key_value_heads"],
        head_dim=RECIPE["head_dim"],
        intermediate_size=RECIPE["intermediate_size"],
        max_position_embeddings=RECIPE["max_position_embeddings"],
        rope_theta=RECIPE["rope_theta"],
        tie_word_embeddings=False,
        bos_token_id=raw.token_to_id(IM_START),
        eos_token_id=raw.token_to_id(IM_END),
        pad_token_id=raw.token_to_id(PAD_TOKEN),
        torch_dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(int(RECIPE["init_seed"]))
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    _canonicalise_json(out)


def _canonicalise_json(out: Path) -> None:
    """Sort keys and drop version stamps so the same recipe gives the same bytes."""
    for path in out.glob("*.json"):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            data.pop("transformers_version", None)
        path.write_text(json.dumps(data, sort_keys=True, indent=1, ensure_ascii=False) + "\n")
