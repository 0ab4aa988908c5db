"""The engine: one frozen base model, many LoRA adapters, no network.

The server's layers, and the one direction of their imports (an arrow: "imports"):

    service/ (gRPC front) --> runtime/ --> scheduler --> executor --> engine/
                                 |
                                 +--> store

- `twinkle_server.service` (the gRPC front) owns the wire: protobuf in, a runtime verb,
  protobuf out, and the one map from error categories to status codes. Only it (and the
  assembly in `server.py`) imports grpc; a second front plugs in beside it.
- `twinkle_server.runtime` owns tenants and ownership, op construction (merge groups,
  token costs), the store and the typed verbs (`runtime.training`, `.sampling`, `.runs`)
  over plain values, raising the one error family (`engine.errors`).
- `twinkle_server.scheduling.scheduler` owns order: per-model queues ordered by `seq_id`, idempotent
  retries, and (`twinkle_server.scheduling.planning`) the decisions which ready ops run together
  and when a decode slice runs between training batches. It calls the engine only
  through `twinkle_server.scheduling.executor` (`forward_batch`, `decode` or, with the static
  sampler, `sample_batch`, and one callable per optimizer/save/load op), from its one
  worker thread.
- `twinkle_server.engine` (this package) owns the model and every adapter's state:
  `types` its value types, `base_model` the frozen base, `lora` the multi-LoRA layers and
  row routing, `forward` the merged pass (`packing`: datums packed into one
  sequence, attention confined to each; `logprobs`: target logprobs from hidden states in
  chunks through the output layer; `activations`: optional activation checkpointing),
  `memory` the pass headroom estimate and the memory free, `adapter` one object per
  adapter with its optimizer verbs, `losses`, `optim`, `decoding` (continuous batching:
  the decode pool, its KV bound and prefix cache), `sampler` (the static batch, the
  baseline, and the token-picking rules both share; `sampler_cache`: saved sampler
  checkpoints kept loaded), `checkpoint` (PEFT format, atomic, save and load),
  `parallel` the ranks (`Parallel`: FSDP2 over a process group; `OneRank`, the trivial
  one a process alone uses, every collective the identity, so the pass code has one
  path), and `engine.Engine`, the only entry point. It imports only torch,
  transformers, peft, numpy, safetensors and itself.
- `engine.protocol.EngineAPI` is the engine as the runtime, the executor and the server
  see it, implemented by `Engine` and, on several ranks, by rank 0's
  `twinkle_server.ranks.replication.ReplicatedEngine`. Each public `Engine` method is marked
  once where it is defined: `@replicated` (every rank runs it, in order: `add_adapter`,
  `remove_adapter`, `forward_batch`, the optimizer verbs, `calculate_metric`,
  `load_state`, `decode`, `publish_inflight`, `sample_batch` and the prompt logprobs and
  scoring) or `@rank_zero_only`
  (reads, request checks and saves). `tests/engine/test_protocol.py` fails on a method
  marked neither way, and on a `ReplicatedEngine` that sends anything else.
- `twinkle_server.store` owns durable records (keys, sessions, runs, checkpoint paths)
  beside the runtime, which passes the engine plain file paths from it.

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
