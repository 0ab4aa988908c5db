"""The plain values the typed calls take and return: frozen dataclasses and numpy arrays.

Each mirrors one message of the contract (`protos/twinkle/v1/`) field for field, in
Python types: the clients convert these to their own public records (`twinkle_client`'s
pydantic models, `tinker.types`), never a message. The values the server's engine takes
as they are (`AdamParams`, `SamplingParams`, `ServerLimits`, `Datum`) are the contract's
own, in `twinkle_wire`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from twinkle_wire.values import ServerLimits

T = TypeVar("T")


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter as CreateModel takes it: `target_modules` (names or suffixes) or
    `all_linear` choose its layers; with neither, Tinker's `train_mlp`/`train_attn`/
    `train_unembed` switches do. `alpha` 0 is the server default (32); `seed` None is
    random."""

    rank: int
    alpha: float = 0.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    all_linear: bool = False
    use_rslora: bool = False
    seed: int | None = None
    train_mlp: bool = False
    train_attn: bool = False
    train_unembed: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """A training model (one adapter, one run): `next_seq_id` is where its ops start."""

    model_id: str
    base_model: str
    arch: str
    tokenizer_id: str
    is_lora: bool
    lora_rank: int
    next_seq_id: int
    target_modules: tuple[str, ...]
    trainable_params: int
    state_bytes: int


@dataclass(frozen=True)
class Loss:
    """A loss by name with its numeric config; the empty name is the loss set with
    `set_loss` (native client)."""

    name: str = ""
    config: Mapping[str, float] = field(default_factory=dict)


@dataclass
class ForwardResult:
    """What a forward/forward_backward returns: per-datum outputs in datum order (each a
    dict such as {"logprobs": float32 [T]}), the loss and the metrics ("name:reduction")."""

    outputs: list[dict[str, np.ndarray]]
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Completion:
    """One sampled sequence: tokens, their logprobs, and 'stop' or 'length'."""

    tokens: np.ndarray
    logprobs: np.ndarray
    stop_reason: str
    topk_token_ids: np.ndarray | None = None   # int32 [n, k] with topk_sample_logprobs
    topk_logprobs: np.ndarray | None = None    # float32 [n, k]
    sequence_id: str = ""   # names it in a datum's provenance (recorded with record_stability_info)


@dataclass(frozen=True)
class SampleResult:
    """A Sample reply. `prompt_logprobs` (NaN at 0) when asked for; with top-k prompt
    logprobs, the k likeliest tokens at each prompt position and their logprobs."""

    sequences: list[Completion]
    prompt_logprobs: np.ndarray | None = None
    topk_token_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    target_logprobs: np.ndarray | None = None   # float32 [T - 1, K], 0.0 where id was -1
    alt_tokens: np.ndarray | None = None        # int64 [T - 1, k]
    alt_logprobs: np.ndarray | None = None      # float32 [T - 1, k]
    prompt_cache_hit_tokens: int = 0            # prompt tokens reused from the session's cache


@dataclass(frozen=True)
class SamplingSession:
    sampling_session_id: str
    base_model: str
    model_path: str


@dataclass(frozen=True)
class Checkpoint:
    """A saved checkpoint; `path` is its twinkle:// path, times are unix seconds."""

    checkpoint_id: str
    checkpoint_type: str
    path: str
    run_id: str
    name: str
    created_at: float
    size_bytes: int
    has_optimizer: bool
    base_model: str
    lora_rank: int
    user_metadata: dict[str, str]
    public: bool = False                # readable by every tenant of the server
    expires_at: float | None = None     # unix seconds it is deleted at; None: never
    # Tinker's switches its run was made with; None: made with module names.
    train_attn: bool | None = None
    train_mlp: bool | None = None
    train_unembed: bool | None = None


@dataclass(frozen=True)
class AuditEntry:
    """One audit log entry: unix `timestamp`, `event` (`<resource>_<action>`) and what
    it was about (`details`: actor, model_id, tinker_path, ...)."""

    timestamp: float
    event: str
    details: dict[str, Any]


@dataclass(frozen=True)
class TrainingRun:
    run_id: str
    base_model: str
    owner: str
    is_lora: bool
    lora_rank: int
    created_at: float
    last_request_time: float
    last_checkpoint: Checkpoint | None
    last_sampler_checkpoint: Checkpoint | None
    user_metadata: dict[str, str]
    loaded: bool
    corrupted: bool


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a listing: its items, the total, and the next offset (-1: no more)."""

    items: list[T]
    total: int
    next_offset: int


@dataclass(frozen=True)
class ServedModel:
    name: str
    aliases: tuple[str, ...]
    max_context_length: int
    vocab_size: int
    trainable: bool
    sampleable: bool
    arch: str
    role: str = "train"
    limits: ServerLimits | None = None
    """This model's max_adapters, max_rank, max_seq_len and max_batch_tokens (the
    server-wide fields are 0 here)."""


@dataclass(frozen=True)
class Capabilities:
    """What the server serves and allows, and its free adapter slots and memory."""

    models: tuple[ServedModel, ...]
    limits: ServerLimits
    scheduling: str
    server_version: str
    adapters_loaded: int
    adapters_free: int
    memory_available_bytes: int
    loss_functions: tuple[str, ...]
    optimizers: tuple[str, ...]
    lr_schedulers: tuple[str, ...]
