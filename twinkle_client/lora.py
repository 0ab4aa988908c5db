"""A peft `LoraConfig` as the LoRA spec a Twinkle server takes, or a refusal naming the field.

The server honours `r`, `lora_alpha`, `lora_dropout`, `target_modules` ('all-linear' or a
list of module names/suffixes) and `use_rslora`. Any other field set away from peft's
default would be silently dropped by the server, so it is refused here, before anything
is sent.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from twinkle_client import api
from twinkle_client.errors import require_int

if TYPE_CHECKING:
    from peft import LoraConfig

MAPPED_LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora")
"""peft.LoraConfig fields the server honours."""
IGNORED_LORA_FIELDS = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path",
    "revision", "inference_mode", "megatron_core", "qalora_group_size", "runtime_config"})
"""Bookkeeping fields that do not change what is trained."""
ALL_LINEAR = "all-linear"


def lora_spec(config: LoraConfig | Mapping[str, Any], seed: int | None = None) -> api.LoraSpec:
    """A peft `LoraConfig` (or a dict of its fields) as the wire's LoRA spec.

    Raises:
        ValueError: naming the field: an unsupported field, a regex `target_modules`
            string, no target_modules, a rank < 1, or alpha <= 0.

    Example:
        spec = lora_spec(LoraConfig(r=8, target_modules='all-linear'), seed=0)
    """
    from peft import LoraConfig

    if isinstance(config, Mapping):
        known = {f.name for f in dataclasses.fields(LoraConfig)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"lora_config.{unknown[0]}: not a peft LoraConfig field")
        config = LoraConfig(**config)
    if not isinstance(config, LoraConfig):
        raise ValueError(f"lora_config: expected a peft.LoraConfig or a dict, got "
                         f"{type(config).__name__}")
    default = LoraConfig()
    for f in dataclasses.fields(LoraConfig):
        if f.name in MAPPED_LORA_FIELDS or f.name in IGNORED_LORA_FIELDS:
            continue
        value, expected = getattr(config, f.name), getattr(default, f.name)
        if value != expected:
            raise ValueError(
                f"lora_config.{f.name}: {value!r} is not supported by the Twinkle server, "
                f"which honours only {list(MAPPED_LORA_FIELDS)}; leave it at {expected!r}")
    require_int(config.r, "lora_config.r")
    alpha = float(config.lora_alpha)
    if not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"lora_config.lora_alpha: must be > 0, got {config.lora_alpha!r}")
    targets = config.target_modules
    if targets is None:
        raise ValueError("lora_config.target_modules: not set; pass 'all-linear' or a list "
                         "of module names such as ['q_proj', 'v_proj']")
    if isinstance(targets, str) and targets.lower() != ALL_LINEAR:
        raise ValueError(f"lora_config.target_modules: the regex {targets!r} is not "
                         "supported over the wire; pass 'all-linear' or a list of names")
    return api.LoraSpec(
        rank=config.r, alpha=alpha, dropout=float(config.lora_dropout),
        use_rslora=bool(config.use_rslora), all_linear=isinstance(targets, str),
        target_modules=() if isinstance(targets, str) else tuple(sorted(targets)),
        seed=None if seed is None else int(seed))
