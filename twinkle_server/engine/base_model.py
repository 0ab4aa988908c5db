"""Loading the one frozen base model every adapter trains on."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from twinkle_server.engine.errors import InvalidArgument, NotFound
from twinkle_server.engine.tiny_model import TINY_MODEL_NAME, build_tiny_model

log = logging.getLogger(__name__)


@dataclass
class BaseModel:
    """The frozen causal LM, its tokenizer and the facts about it the server reports.

    `model` has `requires_grad` False everywhere and is in eval mode; the engine's
    multi-LoRA layers are the only trainable tensors. `model_dir` holds the config,
    weights and tokenizer files (the server ships the tokenizer files to clients).
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    model_dir: Path
    device: torch.device
    dtype: torch.dtype

    @property
    def config(self):
        return self.model.config

    @property
    def tokenizer_dir(self) -> Path:
        """The directory holding the tokenizer files (`tokenizer.json`, its config)."""
        return self.model_dir

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: valid token ids are `[0, vocab_size)`."""
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def max_seq_len(self) -> int:
        """The model's context length (`max_position_embeddings`)."""
        return int(getattr(self.config, "max_position_embeddings", 0) or 4096)

    @property
    def arch(self) -> str:
        return (getattr(self.config, "architectures", None) or [type(self.model).__name__])[0]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(sorted(set(ids)))

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = self.config.pad_token_id
        return int(pad if pad is not None else self.eos_token_ids[0])

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise InvalidArgument(f"dtype: {dtype!r} is not one of {sorted(choices)} or 'auto'")
    return choices[dtype]


def _cached_snapshot(model_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception as exc:
        raise NotFound(
            f"model: {model_id!r} is neither 'tiny', a local model directory, nor in the local "
            f"Hugging Face cache (nothing is downloaded): {type(exc).__name__}") from None


def load_base_model(model: str, *, device: str = "auto", dtype: str = "auto",
                    cache_dir: str | Path | None = None) -> BaseModel:
    """Load `model`: `'tiny'` (built offline), a local HF directory, or an id in the HF cache.

    Never downloads: hub ids resolve only from the local cache (`local_files_only`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model == TINY_MODEL_NAME:
        path: str | Path = build_tiny_model(cache_dir)
    elif Path(model).expanduser().is_dir():
        path = Path(model).expanduser()
    else:
        path = _cached_snapshot(model)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    log.info("loading base model %s (%s, %s)", model, torch_device, torch_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        hf_model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, local_files_only=True)
    except OSError as exc:
        raise NotFound(
            f"model: {model!r} is neither 'tiny', a local model directory, nor in the local "
            f"Hugging Face cache (nothing is downloaded): {exc}") from None
    hf_model.to(torch_device).eval()
    hf_model.requires_grad_(False)
    return BaseModel(model=hf_model, tokenizer=tokenizer, name=model, model_dir=Path(path),
                     device=torch_device, dtype=torch_dtype)
