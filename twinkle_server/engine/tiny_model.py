"""The embedded `tiny` base model: a small Qwen3 causal LM built offline, deterministically.

Tests and the demo use it instead of a hub model (`--model tiny`). The recipe below
(architecture, seed, tokenizer settings, chat template) and the shipped corpus
`tiny_corpus.txt` fully determine the output: the same code gives byte-identical files
(sorted JSON without version stamps, safetensors weights, tokenizer). The cache directory is
named by a hash of recipe + template + corpus, so a changed recipe never reuses stale files.

Layout of a built directory (a normal Hugging Face model dir, loadable offline with
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`):
`config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json` (with the ChatML `chat_template`) and an empty `.complete` marker.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from twinkle_server.engine.errors import FailedPrecondition

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TINY_MODEL_NAME = "tiny"
TINY_LARGE_NAME = "tiny-large"
"""A second built-in base: same tokenizer as `tiny`, another shape and seed, so a test or
a local recipe has a teacher or grader of a different base beside its student."""

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: pad 0, im_start 1, im_end 2 (the BPE trainer adds them first).
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START, IM_END)
# The control tokens of the families whose renderers tinker-cookbook ships, so a recipe that
# renders for a hosted model runs on `tiny` unchanged: the renderers encode these strings and
# assert one id each (Qwen3.5's `</think>`, gpt-oss's `<|return|>`/`<|call|>`, Llama 3's
# `<|eot_id|>`, ...). They take the last ids of the vocabulary, after the BPE merges, so
# the ids of every merge the trainer learned before they were added stay the same.
# As in Qwen3's tokenizer, its tags are added tokens that are *not* special: decoding with
# `skip_special_tokens=True` keeps `<think>...</think>`, which the renderers parse.
QWEN_TAGS: tuple[str, ...] = (
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
    "</tool_response>",
)
# Special (dropped by `skip_special_tokens`) like pad/im_start/im_end.
FAMILY_SPECIAL_TOKENS: tuple[str, ...] = (
    # Qwen3-VL / Qwen3.5 image markers.
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    # Llama 3.
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
    # gpt-oss (Harmony).
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
    "<|call|>",
)
# Every string the tokenizer encodes as one id, in id order: 0, 1, 2, then the last ids.
ADDED_TOKENS: tuple[str, ...] = (*SPECIAL_TOKENS, *QWEN_TAGS, *FAMILY_SPECIAL_TOKENS)

# Qwen3 architecture, about 1.8M parameters (1M of them the two untied 4096 x 128 embeddings):
# small enough that a CPU test trains it in seconds.
RECIPE: dict[str, object] = {
    # Ids in all, the added tokens included; the shipped corpus has enough merges to fill it.
    "vocab_size": 4096,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "init_seed": 1234,
    "added_tokens": list(ADDED_TOKENS[len(SPECIAL_TOKENS):]),  # the last ids, in order
    "format": 2,  # bump when the writer changes the files for the same recipe
}
# About 4.4M parameters: wider and deeper than `tiny`, with the same vocabulary.
RECIPES: dict[str, dict[str, object]] = {
    TINY_MODEL_NAME: RECIPE,
    TINY_LARGE_NAME: {**RECIPE, "hidden_size": 192, "num_hidden_layers": 6,
                      "num_attention_heads": 6, "head_dim": 32, "intermediate_size": 576,
                      "init_seed": 4321},
}
"""Every built-in base by name: `--model tiny`, or `path = "tiny-large"` in a models file."""

# ChatML, and with tools Qwen3's tool format: the tools as JSON in a system turn, a call
# as `<tool_call>` JSON `</tool_call>` in the assistant's turn, a tool's answer inside
# `<tool_response>` in a user turn. Messages without tools render as plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{%- if message['tool_calls'] is defined %}{%- for call in message['tool_calls'] %}"
    "{%- if not loop.first or message['content'] %}{{- '\n' }}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{%- if call['function']['arguments'] is string %}{{- call['function']['arguments'] }}"
    "{%- else %}{{- call['function']['arguments'] | tojson }}{%- endif %}"
    "{{- '}\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

_CORPUS = Path(__file__).with_name("tiny_corpus.txt")
_DONE_MARKER = ".complete"


def recipe_hash(name: str = TINY_MODEL_NAME) -> str:
    """Short hash of everything that determines the files of built-in base `name`: recipe,
    template and corpus."""
    digest = hashlib.sha256(json.dumps(RECIPES[name], sort_keys=True).encode())
    digest.update(CHAT_TEMPLATE.encode())
    digest.update(_CORPUS.read_bytes())
    return digest.hexdigest()[:12]


def default_cache_root() -> Path:
    """`$TWINKLE_CACHE_DIR`, else `~/.cache/twinkle`: the parent of the built model dir."""
    env = os.environ.get("TWINKLE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "twinkle"


def build_tiny_model(cache_dir: str | os.PathLike | None = None,
                     name: str = TINY_MODEL_NAME) -> Path:
    """Return the directory of built-in base `name` (a key of `RECIPES`), building it first
    if it is not cached.

    Args:
        cache_dir: parent folder of the model dir; defaults to `default_cache_root()`.
        name: `tiny` or `tiny-large`.

    Returns:
        `<cache_dir>/<name>-qwen3-<recipe_hash(name)>`, complete. A cached dir is returned at once
        (this runs at every server start); a build takes a few seconds, mostly imports.

    Raises:
        FailedPrecondition: the target path exists but is not a complete build (it was not
            written by this function, which only ever renames finished builds into place).

    Safe to call from several processes at once: each builds into its own temp dir beside
    the target and renames it into place; a process that loses the race uses the winner's.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / f"{name}-qwen3-{recipe_hash(name)}"
    if _is_complete(target):
        return target
    if target.exists():
        raise FailedPrecondition(
            f"cache_dir: {target} exists but is not a complete tiny-model build "
            f"(no {_DONE_MARKER} marker); delete it and retry")
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".tiny-build-", dir=root))
    try:
        _write_model(scratch, RECIPES[name])
        (scratch / _DONE_MARKER).write_bytes(b"")
        try:
            os.rename(scratch, target)
        except OSError:
            # Lost the race: another builder renamed its identical build into place first.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _is_complete(path: Path) -> bool:
    return (path / _DONE_MARKER).is_file()


def _corpus_records() -> list[str]:
    """The corpus split at blank lines, newlines kept, so BPE also learns line breaks."""
    text = _CORPUS.read_text(encoding="utf-8")
    return [record.strip("\n") + "\n" for record in text.split("\n\n") if record.strip()]


def _train_tokenizer() -> Tokenizer:
    """Byte-level BPE (as GPT-2/Qwen): every string encodes, and decodes back unchanged.

    The trainer stops `len(ADDED_TOKENS) - len(SPECIAL_TOKENS)` merges short of
    `vocab_size`; the family tokens then take the last ids, so BPE is a prefix of what it
    learns with the full budget and the ids of pad/im_start/im_end and every merge kept stay.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    extra = len(ADDED_TOKENS) - len(SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=int(RECIPE["vocab_size"]) - extra,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_records(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_TAGS])
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in FAMILY_SPECIAL_TOKENS])
    if tokenizer.get_vocab_size() != int(RECIPE["vocab_size"]):
        raise AssertionError(f"tiny tokenizer has {tokenizer.get_vocab_size()} ids, "
                             f"the recipe {RECIPE['vocab_size']}: the corpus ran out of merges")
    return tokenizer


def _write_model(out: Path, recipe: dict[str, object]) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    raw = _train_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START, *FAMILY_SPECIAL_TOKENS],
        model_max_length=int(recipe["max_position_embeddings"]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    # Template inside tokenizer_config.json, where older transformers and other tools look.
    tokenizer.save_pretrained(out, save_jinja_files=False)

    pad_id, eos_id = raw.token_to_id(PAD_TOKEN), raw.token_to_id(IM_END)
    config = Qwen3Config(
        vocab_size=raw.get_vocab_size(),
        hidden_size=recipe["hidden_size"],
        num_hidden_layers=recipe["num_hidden_layers"],
        num_attention_heads=recipe["num_attention_heads"],
        num_key_value_heads=recipe["num_key_value_heads"],
        head_dim=recipe["head_dim"],
        intermediate_size=recipe["intermediate_size"],
        max_position_embeddings=recipe["max_position_embeddings"],
        rope_theta=recipe["rope_theta"],
        tie_word_embeddings=False,
        # As in Qwen3: bos is <|endoftext|> in the config, and the tokenizer adds no bos.
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    # Seed a forked RNG so building never shifts the caller's random stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(recipe["init_seed"]))
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config.bos_token_id = pad_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out, safe_serialization=True)
    _canonicalise_json(out)


def _canonicalise_json(out: Path) -> None:
    """Sort keys and drop version stamps so the same recipe gives the same bytes."""
    for path in sorted(out.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict):
            data.pop("transformers_version", None)
        text = json.dumps(data, sort_keys=True, indent=1, ensure_ascii=False) + "\n"
        path.write_text(text, encoding="utf-8")
