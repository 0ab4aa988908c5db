"""Tiny random models of the architecture families Tinker users train, built offline.

Each family is its transformers config class at toy sizes (hidden 64, a few layers, a few
experts), random weights from a fixed seed, and the tiny model's own tokenizer, written
as a model directory the engine loads like any local model. Hybrids get both of their
layer kinds; MoE models both dense and expert layers where the family has both.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from packaging.version import Version

from twinkle_server.engine import recurrent
from twinkle_server.engine.engine import Engine
from twinkle_server.engine.tiny_model import build_tiny_model, default_cache_root
from twinkle_server.engine.types import Datum

# Shared by every family: small enough that a forward_backward takes milliseconds.
_COMMON: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, intermediate_size=128,
                               max_position_embeddings=512, tie_word_embeddings=False)
_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "smollm3": ("SmolLM3Config", {}),
    "mistral": ("MistralConfig", {"sliding_window": 16}),
    "gemma3_text": ("Gemma3TextConfig", {"sliding_window": 16, "num_hidden_layers": 2,
                                         "layer_types": ["sliding_attention",
                                                         "full_attention"]}),
    "phi3": ("Phi3Config", {}),
    # Attention logit soft-capping (eager-only in transformers); sliding and full layers.
    "gemma2": ("Gemma2Config", {"sliding_window": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_MOE, decoder_sparse_step=1, mlp_only_layers=[0])),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(
        _MOE, num_hidden_layers=4, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "linear_attention", "linear_attention",
                     "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4)),
    "qwen3_next": ("Qwen3NextConfig", dict(
        _MOE, num_hidden_layers=4, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "linear_attention", "linear_attention",
                     "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4)),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention",
                     "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=32, sliding_window=16,
                                     layer_types=["sliding_attention", "full_attention"])),
    "glm4_moe": ("Glm4MoeConfig", dict(n_routed_experts=4, num_experts_per_tok=2,
                                       moe_intermediate_size=32, n_shared_experts=1,
                                       first_k_dense_replace=1, n_group=1, topk_group=1)),
    "nemotron_h": ("NemotronHConfig", dict(
        num_hidden_layers=4, hybrid_override_pattern="M*-E", mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=1, mamba_d_conv=4,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1)),
    # Not a Tinker family: a hybrid whose short convolution (`Lfm2ShortConv`) carries state
    # along the sequence in a kind the engine does not pack (`engine.recurrent`).
    "lfm2": ("Lfm2Config", {"layer_types": ["conv", "full_attention"]}),
}
"""Family name -> (transformers config class, its settings over `_COMMON`)."""


def family_config(family: str, vocab_size: int, **overrides: Any
                  ) -> transformers.PretrainedConfig:
    """`family`'s config at toy sizes, over the tiny tokenizer's `vocab_size`; skips the
    test where the installed transformers predates the family (the engine could not load
    it there either: `make test-oldest`)."""
    class_name, settings = FAMILIES[family]
    cls = getattr(transformers, class_name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {class_name}")
    return cls(**{**_COMMON, **settings, "vocab_size": vocab_size, **overrides},
               dtype="float32")


def _tiny_tokenizer_in(out: Path, tiny_cache: Path):
    """A new model directory `out` holding the tiny model's tokenizer files; the
    tokenizer."""
    tiny = build_tiny_model(tiny_cache)
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    return transformers.AutoTokenizer.from_pretrained(out)


def write_family(root: Path, family: str, tiny_cache: Path, seed: int = 0,
                 qk_scale: float = 1.0, **overrides: Any) -> Path:
    """A model directory of `family` under `root` with the tiny model's tokenizer and
    random weights from `seed`; returns it (written once per root). `qk_scale` multiplies
    every `q_proj` and `k_proj` weight, so attention logits grow by its square: random
    weights give logits of order 1, under any real logit soft cap."""
    out = root / family
    if (out / "config.json").exists():
        return out
    tokenizer = _tiny_tokenizer_in(out, tiny_cache)
    config = family_config(family, len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                           eos_token_id=tokenizer.eos_token_id, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if qk_scale != 1.0 and name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.mul_(qk_scale)
    model.save_pretrained(out, safe_serialization=True)
    return out


MULTIMODAL: dict[str, tuple[str, str]] = {
    "qwen3_5_text": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration"),
    "qwen3_5_moe_text": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration"),
}
"""Text family -> (its multimodal config class, the architecture real checkpoints declare).
transformers' AutoModelForCausalLM loads these as the text-only class (`*ForCausalLM`,
`model.layers.N`), while the checkpoint's own class keeps the text model under
`model.language_model.`."""


def write_multimodal(root: Path, family: str, tiny_cache: Path, seed: int = 0) -> Path:
    """A model directory as real checkpoints of `family` ship: its multimodal
    architecture (`MULTIMODAL`) with a one-block vision tower, the text model `family`'s
    toy config; the tiny tokenizer, random weights from `seed` (written once per root)."""
    out = root / f"{family}_multimodal"
    if (out / "config.json").exists():
        return out
    config_name, arch = MULTIMODAL[family]
    if getattr(transformers, arch, None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {arch}")
    tokenizer = _tiny_tokenizer_in(out, tiny_cache)
    text = family_config(family, len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    config = getattr(transformers, config_name)(
        text_config=text.to_dict(), tie_word_embeddings=False,
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=text.hidden_size, patch_size=4,
                           spatial_merge_size=1, temporal_patch_size=1))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, arch)(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


SOFT_CAPPED: dict[str, Any] = dict(attn_logit_softcapping=5.0, qk_scale=12.0)
"""`write_family` arguments of a tiny Gemma 2 whose attention logit soft cap bites: q and
k weights x12 give attention logits up to 3.8 where random weights give 0.03, and a cap of
5 bends them (tanh(3.8 / 5) * 5 = 3.2); without the cap its logprobs move by 0.06."""


def random_datums(engine: Engine, lengths: tuple[int, ...], seed: int = 0) -> list[Datum]:
    """Cross-entropy datums of random tokens, `lengths[i]` input tokens each: lengths
    the fixed sentences do not reach (past a sliding window, or a rope's limit)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(10, min(engine.base.vocab_size, 4000), size=n + 1).astype(np.int64)
        out.append(Datum(ids[:-1], {"target_tokens": ids[1:],
                                    "weights": np.ones(n, np.float32)}))
    return out


def next_token_datums(engine: Engine, texts: list[str]) -> list[Datum]:
    """Cross-entropy datums predicting each text's next tokens, with the engine's
    tokenizer: the family tests' shared data."""
    out = []
    for text in texts:
        ids = np.asarray(engine.base.tokenizer(text)["input_ids"], dtype=np.int64)
        out.append(Datum(ids[:-1], {"target_tokens": ids[1:],
                                    "weights": np.ones(ids.size - 1, np.float32)}))
    return out


def peft_logprobs(model: torch.nn.Module, datum: Datum, grad: bool = False):
    """A transformers (+ peft) model's logprobs of a datum's targets, as numpy (with
    `grad`: a torch tensor carrying its graph, for a plain training loop)."""
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=torch.from_numpy(datum.input_ids)[None]).logits[0].float()
        targets = torch.from_numpy(datum.loss_inputs["target_tokens"])
        out = -torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return out if grad else out.numpy()


def randomize_b(engine: Engine, adapter_id: str, seed: int, scale: float) -> None:
    """Give an adapter's B matrices (linears and experts) random values from `seed`
    times `scale`: a new adapter's delta is 0, and parity checks need one that is not."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weights in engine.adapters[adapter_id].weights.values():
            weights.lora_B.copy_(torch.randn(weights.lora_B.shape, generator=generator)
                                 * scale)


def skip_unserved_experts(engine: Engine) -> Engine:
    """`engine`, or a skip where the installed transformers' experts predate the experts
    interface the engine's expert LoRA computes on: there the engine refuses an adapter on
    them by name (`engine.experts.targets`), so Tinker's default cannot train them."""
    if engine.experts.unserved:
        cls = next(iter(engine.experts.unserved.values()))[0]
        pytest.skip(f"transformers {transformers.__version__}'s experts ({cls}) predate "
                    "the experts interface this engine's expert LoRA computes on")
    return engine


MIXER_FAMILIES = frozenset({"qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "nemotron_h"})
"""Families with Gated DeltaNet or Mamba2 mixers (`engine.recurrent.MIXERS`)."""


def skip_unchecked_mixers(family: str) -> None:
    """Skip where the installed transformers predates the one the engine's mixers were
    checked on: the engine refuses such a model at load there (`recurrent.refusal`)."""
    if family in MIXER_FAMILIES and (Version(transformers.__version__)
                                     < Version(recurrent.VERIFIED_TRANSFORMERS)):
        pytest.skip(f"transformers {transformers.__version__}: the engine refuses "
                    f"{family}'s mixers there (recurrent.refusal)")


def main(argv: list[str]) -> None:
    """`python -m tests.engine.families OUT FAMILY...`: write each family's tiny model under
    OUT, with the tiny model's tokenizer (built first under `$TWINKLE_CACHE_DIR`, else
    ~/.cache/twinkle), and print its directory: `make cookbook-check` serves them."""
    out, *families = argv
    for family in families:
        print(write_family(Path(out), family, default_cache_root()))


if __name__ == "__main__":
    main(sys.argv[1:])
