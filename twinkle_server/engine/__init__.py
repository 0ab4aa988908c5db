"""The engine: one frozen base model, many LoRA adapters, no network.

Map of the server and who owns what:

- `twinkle_server.service` (gRPC servicers) owns the wire: it turns protobuf messages into
  the engine's frozen value types (`engine.types`), validates them, and maps
  `engine.errors` categories to status codes. It never touches torch.
- `twinkle_server.scheduler` owns order: per-model queues ordered by `seq_id`, idempotent
  retries, and the decision which ready ops run together. It calls the engine only
  through `twinkle_server.executor` (`forward_batch`, `sample_batch`, and one callable
  per optimizer/save/load op), from its one worker thread.
- `twinkle_server.engine` (this package) owns the model and every adapter's state:
  `base_model` loads the frozen base, `lora` the multi-LoRA layers and row routing,
  `adapter` one object per adapter holding all its state, `losses`, `optim`, `sampler`,
  `checkpoint` (PEFT format, atomic), and `engine.Engine`, the only entry point.
- `twinkle_server.store` owns durable records (keys, sessions, runs, checkpoint paths)
  beside the engine; the services pass the engine plain file paths from it.

The engine talks back only through return values: results, or an `EngineError` value per
failed request, so one tenant's bad request never stops another's.

Exports are loaded lazily so importing `engine.types` (for configuration and `--help`)
does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from twinkle_server.engine.base_model import BaseModel, load_base_model
    from twinkle_server.engine.engine import Engine
    from twinkle_server.engine.types import ForwardRequest, SampleRequest

__all__ = ["BaseModel", "Engine", "ForwardRequest", "SampleRequest", "load_base_model"]

_HOMES = {"BaseModel": "base_model", "load_base_model": "base_model", "Engine": "engine",
          "ForwardRequest": "types", "SampleRequest": "types"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
