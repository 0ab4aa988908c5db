"""Loading the one frozen base model every adapter trains on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from twinkle_server.engine import hub
from twinkle_server.engine.errors import InvalidArgument, NotFound
from twinkle_server.engine.tiny_model import RECIPES, build_tiny_model

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
    def text_config(self):
        """The language model's config: `config` itself, or a multimodal model's text
        part (Gemma 3's keeps its context length and EOS ids there)."""
        config = self.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

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
        return int(getattr(self.text_config, "max_position_embeddings", 0) or 4096)

    @property
    def arch(self) -> str:
        return (getattr(self.config, "architectures", None) or [type(self.model).__name__])[0]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for config in (self.config, self.text_config):
            found = getattr(config, "eos_token_id", None)
            ids += [found] if isinstance(found, int) else list(found or [])
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(sorted(set(ids)))

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.text_config, "pad_token_id", None)
        return int(pad if pad is not None else self.eos_token_ids[0])

    def decode(self, ids) -> str:
        """The text of `ids` as a client is shown it, special tokens left out (as vLLM
        does): stop strings are matched in it, and the OpenAI route answers with it."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def hidden_states(self, **inputs) -> torch.Tensor:
        """`last_hidden_states(self.model, **inputs)`."""
        return last_hidden_states(self.model, **inputs)


def last_hidden_states(model: torch.nn.Module, **inputs) -> torch.Tensor:
    """The last hidden states `[batch, seq, hidden]` of one pass of `model`'s decoder (its
    forward minus the output layer: `check_output_head` verifies that the output layer
    and `final_logit_transform` turn them into the model's logits); `inputs` as for the
    model's forward."""
    out = model.get_decoder()(**inputs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def final_logit_transform(config) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The function the model applies to `lm_head(h)` before returning its logits.

    None for most models; Gemma 2/3's `final_logit_softcapping` (`cap * tanh(z / cap)`),
    Cohere's `logit_scale` (`z * scale`) and Granite's `logits_scaling` (`z / scaling`),
    read from the (text) config. Any other transform is caught by `check_output_head`.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    divide = getattr(config, "logits_scaling", None)
    steps: list[Callable[[torch.Tensor], torch.Tensor]] = []
    if cap is not None:
        steps.append(lambda z: torch.tanh(z / cap) * cap)
    if isinstance(scale, (int, float)) and scale != 1:
        steps.append(lambda z: z * scale)
    if isinstance(divide, (int, float)) and divide != 1:
        steps.append(lambda z: z / divide)
    if not steps:
        return None
    if len(steps) > 1:
        raise InvalidArgument(
            "model: the config sets more than one final logit transform "
            "(final_logit_softcapping, logit_scale, logits_scaling); the engine applies at "
            "most one, in the model's own order it cannot know")
    return steps[0]


def _capped_attention_in_eager(model: torch.nn.Module) -> None:
    """Run a model whose attention soft-caps its logits (Gemma 2's
    `attn_logit_softcapping`) in eager attention: sdpa cannot cap, and transformers
    before 5.x chose sdpa for Gemma 2 by default, dropping the cap wherever the engine
    keeps the model's own attention."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_logit_softcapping", None) and config._attn_implementation == "sdpa":
        log.info("attention soft cap: eager attention (sdpa cannot cap)")
        config._attn_implementation = "eager"
        text._attn_implementation = "eager"


# A probe this long exercises attention and the output layer, and costs one small pass.
_PROBE_TOKENS = 8


def check_output_head(model: torch.nn.Module) -> None:
    """Refuse a model whose logits are not `transform(output_layer(last hidden state))`.

    The engine computes training logprobs from the decoder's last hidden states a chunk of
    tokens at a time (`engine.logprobs`), never from the model's own `[tokens x vocab]`
    logits; this compares both on a short probe once, at load, so an architecture that
    does something else to its logits fails here with a clear message instead of
    training on wrong numbers. Raises InvalidArgument.
    """
    arch = (getattr(model.config, "architectures", None) or [type(model).__name__])[0]
    head = model.get_output_embeddings()
    decoder = model.get_decoder()
    if head is None or decoder is model:
        raise InvalidArgument(
            f"model: {arch} has no separate decoder and output layer "
            "(get_decoder / get_output_embeddings); the engine needs both to compute "
            "logprobs from hidden states in chunks")
    device = next(model.parameters()).device
    vocab = int(model.get_input_embeddings().weight.shape[0])
    ids = (torch.arange(_PROBE_TOKENS, device=device) * 7919 % vocab)[None]
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.float()
        got = head(last_hidden_states(model, input_ids=ids, use_cache=False))
        transform = final_logit_transform(model.config)
        got = (transform(got) if transform is not None else got).float()
    # The same ops on the same tensors: equal but for rounding (bf16: 2^-8 relative).
    scale = float(want.abs().max()) or 1.0
    if got.shape != want.shape or float((got - want).abs().max()) > 1e-2 * scale:
        raise InvalidArgument(
            f"model: {arch}'s logits are not its output layer applied to the last hidden "
            "state (with final_logit_softcapping, logit_scale or logits_scaling when "
            "set); the engine computes logprobs from hidden states in chunks and cannot "
            "serve this architecture")


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


def model_dir(model: str, cache_dir: str | Path | None = None) -> Path:
    """Where `model`'s files are: a built-in's cache directory (built first if need be), a
    local directory, or its snapshot in the local Hugging Face cache (the server downloads
    a hub id there before it loads: `engine.hub`)."""
    if model in RECIPES:
        return build_tiny_model(cache_dir, model)
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    if (path := hub.cached(model)) is None:
        raise NotFound(
            f"model: {model!r} is neither a built-in ('tiny', 'tiny-large'), a local model "
            "directory, nor in the local Hugging Face cache (`twinkle-server serve` "
            "downloads a hub id at start unless --offline on or HF_HUB_OFFLINE)")
    return path


def load_base_model(model: str, *, device: str = "auto", dtype: str = "auto",
                    cache_dir: str | Path | None = None) -> BaseModel:
    """Load `model`: a built-in (`'tiny'`, `'tiny-large'`, built offline), a local HF
    directory, or an id in the HF cache.

    Never downloads: hub ids resolve only from the local cache (`local_files_only`), where
    `engine.hub.fetch` put them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_dir(model, cache_dir)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    log.info("loading base model %s (%s, %s)", model, torch_device, torch_dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        hf_model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, local_files_only=True)
    except OSError as exc:
        raise NotFound(
            f"model: {model!r}'s files in {path} do not load: {exc}") from None
    hf_model.to(torch_device).eval()
    hf_model.requires_grad_(False)
    _capped_attention_in_eager(hf_model)
    check_output_head(hf_model)
    return BaseModel(model=hf_model, tokenizer=tokenizer, name=model, model_dir=Path(path),
                     device=torch_device, dtype=torch_dtype)
