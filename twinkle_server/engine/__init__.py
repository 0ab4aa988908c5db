"""The engine: one frozen base model, many LoRA adapters, no network.

`Engine` (`engine.engine`) is its one entry point: the base and its adapters there, its
training verbs (`training`: merged passes by `forward`, `packing` (with `recurrent` for
linear-attention and Mamba layers), `logprobs`, the
optimizer verbs, PEFT checkpoints named as the base checkpoint's declared architecture
names its modules (`declared`)) beside them, losses, prompt scoring and sampling
(`sampling/`, its decode wing), on one rank or as one of several (`parallel`). LoRA sits
on linears (`lora`) and per expert on MoE experts (`experts`); which of them Tinker's
switches train is read from the model's structure (`roles`), what a pass needs in memory
from its layer kinds (`memory`, `layer_kinds`), and how long a sequence may be from its
context and rotary embedding (`seq_len`). A failed request comes back as an
`EngineError` value, so one
tenant's bad request never stops another's. The rest of the server sees it as
`protocol.EngineAPI`. It imports only torch, transformers, peft, numpy, safetensors, the
contract (`twinkle_wire`) and itself; the server's map is `twinkle_server/__init__.py`.

The runtime, the fronts and the scheduler reach the engine only through
`PUBLIC_MODULES`: this package (its names below, loaded lazily so that importing
`engine.types` for configuration and `--help` does not import torch), `types` (the
values it takes and returns), `errors` (the one error family), `protocol` (`EngineAPI`)
and `checks` (the request checks made before anything is queued).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from twinkle_server.engine.adapter_import import (
        ADAPTER_FILES,
        ImportedAdapter,
        base_linears,
        read_import,
    )
    from twinkle_server.engine.base_model import BaseModel, load_base_model
    from twinkle_server.engine.checkpoint import (
        CONFIG_FILE,
        WEIGHTS_FILE,
        replace_file,
        write_atomically,
    )
    from twinkle_server.engine.engine import Engine
    from twinkle_server.engine.losses import LOSS_NAMES
    from twinkle_server.engine.memory import available_memory_bytes
    from twinkle_server.engine.optim import OPTIMIZERS, SCHEDULERS
    from twinkle_server.engine.prompt_scoring import PromptScoring
    from twinkle_server.engine.types import ForwardRequest, SampleRequest

__all__ = ["ADAPTER_FILES", "CONFIG_FILE", "LOSS_NAMES", "OPTIMIZERS", "PUBLIC_MODULES",
           "SCHEDULERS", "WEIGHTS_FILE", "BaseModel", "Engine", "ForwardRequest",
           "ImportedAdapter", "PromptScoring", "SampleRequest", "available_memory_bytes",
           "base_linears", "load_base_model", "read_import", "replace_file",
           "write_atomically"]

PUBLIC_MODULES: tuple[str, ...] = (
    "twinkle_server.engine",
    "twinkle_server.engine.types",
    "twinkle_server.engine.errors",
    "twinkle_server.engine.protocol",
    "twinkle_server.engine.checks",
)
"""The engine's modules that the runtime, the fronts and the scheduler may import
(`tests/wire/test_wings.py` holds them to it)."""

_HOMES = {
    # the engine and its base, which the assembly builds
    "Engine": "engine", "BaseModel": "base_model", "load_base_model": "base_model",
    # requests the fronts and the runtime build
    "ForwardRequest": "types", "SampleRequest": "types", "PromptScoring": "prompt_scoring",
    # what the server offers: capabilities and metrics
    "LOSS_NAMES": "losses", "OPTIMIZERS": "optim", "SCHEDULERS": "optim",
    "available_memory_bytes": "memory",
    # checkpoints on disk (PEFT's files, written atomically) and adapters trained elsewhere
    "CONFIG_FILE": "checkpoint", "WEIGHTS_FILE": "checkpoint",
    "write_atomically": "checkpoint", "replace_file": "checkpoint",
    "ADAPTER_FILES": "adapter_import",
    "ImportedAdapter": "adapter_import", "base_linears": "adapter_import",
    "read_import": "adapter_import",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
