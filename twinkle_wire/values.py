"""The plain values both sides share: frozen dataclasses that mirror contract messages.

Each mirrors one message of `protos/twinkle/v1/` field for field, so a client builds the
very value the server's engine takes: `AdamParams` (training.proto), `SamplingParams`
(sampling.proto) and `ServerLimits` (session.proto). Defaults are Tinker's where a field
has one (a message's zero values are read by the fronts, which know the field's meaning). The one training sequence, `Datum`, lives
beside its codec in `twinkle_wire.datums`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdamParams:
    """Tinker's `optim_step`: AdamW with exactly these hyper-parameters (decoupled weight
    decay; `grad_clip_norm` 0 = no clipping). The defaults are Tinker's."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request.

    `max_tokens` 0 is up to the context limit (Tinker's None; the server's runtime turns
    it into a number before the engine sees it, and the engine refuses 0). `top_k` <= 0
    and `top_p` 1.0 mean no truncation. Generation stops at the EOS tokens, at any of
    `stop_token_ids`, or once the text ends with any of `stop_strings`; `ignore_eos` does
    not stop at EOS either (Tinker's `stop=[]`) and runs to `max_tokens` unless an
    explicit stop is hit. `seed` None is random.
    """

    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False


@dataclass(frozen=True)
class ServerLimits:
    """The caps a server enforces before any compute, as GetCapabilities reports them."""

    max_adapters: int
    max_rank: int
    max_seq_len: int
    max_batch_tokens: int
    max_message_bytes: int
    max_sessions_per_tenant: int
    max_adapters_per_tenant: int
