"""Plain value types the engine takes and returns.

These are the engine's `*Input/*Output` layer: small frozen dataclasses over numpy
arrays. The gRPC services convert protobuf messages to and from these at the edge;
nothing inside the engine sees a protobuf or a client object. The values the clients
build too (`Datum`, `AdamParams`, `SamplingParams`) are the contract's own, from
`twinkle_wire`, re-exported here for the engine's modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from twinkle_wire.datums import Datum as Datum
from twinkle_wire.values import AdamParams as AdamParams
from twinkle_wire.values import SamplingParams as SamplingParams

ROLE_ATTENTION = "role:attention"
ROLE_MLP = "role:mlp"
ROLE_UNEMBED = "role:unembed"
ROLE_TARGETS: tuple[str, ...] = (ROLE_ATTENTION, ROLE_MLP, ROLE_UNEMBED)
"""`target_modules` entries naming a role, not a module: what Tinker's three switches
select, resolved against the loaded model's structure (`engine.roles`). No module name
holds a colon, so they never clash with PEFT's names."""


TINKER_SWITCHES: tuple[str, ...] = ("train_attn", "train_mlp", "train_unembed")
"""Tinker's `LoraConfig` switches, in `ROLE_TARGETS`' order: the role each one trains."""


def tinker_switches(target_modules: str | Sequence[str]) -> dict[str, bool] | None:
    """`LoraSpec.from_tinker`'s switches read back from an adapter's targets; None for
    one targeting module names (PEFT's way: the native client's adapters, imports),
    which no switch describes, or none at all (an import of expert parameters only:
    `from_tinker` with every switch off is refused: no Tinker run has no target)."""
    if (isinstance(target_modules, str) or not target_modules
            or not set(target_modules) <= set(ROLE_TARGETS)):
        return None
    return {switch: role in target_modules
            for switch, role in zip(TINKER_SWITCHES, ROLE_TARGETS, strict=True)}


@dataclass(frozen=True)
class LoraSpec:
    """One adapter's LoRA shape: `x -> W0 x + scaling * B A x` on every targeted linear.

    `target_modules` follows PEFT: the string `'all-linear'` (every linear layer of the
    decoder except the output head), or a tuple of module-name suffixes; or roles
    (`ROLE_TARGETS`, from `from_tinker`). `scaling` is
    `alpha / rank`, or `alpha / sqrt(rank)` with `use_rslora`.

    `target_parameters` follows PEFT too: MoE expert projections by full name or dotted
    suffix (`'mlp.experts.gate_up_proj'`), LoRA per expert (`engine.experts`), and
    linears by their weight (`'...mlp.shared_experts.gate_proj.weight'`, as exports name
    the linears peft would read as experts: `experts.split_parameters`); None trains the
    experts' projections that `target_modules` names (`'gate_proj'`..., `ROLE_MLP`), an
    empty tuple none.
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"
    use_rslora: bool = False
    seed: int | None = None
    target_parameters: tuple[str, ...] | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_tinker(
        cls,
        rank: int,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> LoraSpec:
        """Tinker's options: alpha 32 as in Tinker; the switches select roles, the same on
        every architecture (`engine.roles`): `train_attn` every linear of the token mixers
        (attention, fused qkv, linear attention, Mamba), `train_mlp` every linear of the
        MLPs (fused gate_up, shared experts), `train_unembed` the output head. Routers are
        never trained. All three off gives no targets (refused when the adapter is made)."""
        targets = tuple(role for role, on in zip(
            ROLE_TARGETS, (train_attn, train_mlp, train_unembed), strict=True) if on)
        return cls(rank=rank, alpha=32.0, target_modules=targets, seed=seed)

    @classmethod
    def from_peft(cls, config: object, seed: int | None = None) -> LoraSpec:
        """From a `peft.LoraConfig` (or anything with its attribute names)."""
        targets = getattr(config, "target_modules", None) or "all-linear"
        if not isinstance(targets, str):
            targets = tuple(sorted(targets))
        parameters = getattr(config, "target_parameters", None)
        return cls(
            rank=int(config.r),
            alpha=float(config.lora_alpha),
            dropout=float(getattr(config, "lora_dropout", 0.0) or 0.0),
            target_modules=targets,
            use_rslora=bool(getattr(config, "use_rslora", False)),
            seed=seed,
            target_parameters=None if parameters is None else tuple(sorted(parameters)),
        )


@dataclass(frozen=True)
class LossSpec:
    """A loss by name with its numeric config (`clip_low_threshold`, `beta`, `epsilon`, ...)."""

    name: str
    config: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ForwardRequest:
    """One request's datums for one adapter; `loss` None means the adapter's native loss."""

    adapter_id: str
    datums: Sequence[Datum]
    loss: LossSpec | None
    backward: bool

    @property
    def num_tokens(self) -> int:
        """Tokens of every datum: the request's share of a merged pass's budget."""
        return sum(datum.num_tokens for datum in self.datums)

    @property
    def num_bytes(self) -> int:
        """Bytes of every datum's arrays: what the request holds while it waits."""
        return sum(datum.num_bytes for datum in self.datums)


@dataclass(frozen=True)
class ForwardOutput:
    """Result of forward / forward_backward for one request: per-datum target logprobs,
    the scalar loss and metrics keyed `name:reduction` (e.g. `loss:sum`)."""

    logprobs: list[np.ndarray]
    loss: float
    metrics: dict[str, float]


StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SampledSequence:
    """One completion: int32 tokens, float32 logprob of each sampled token, why it stopped
    (`stop_text_at`: where the stop string that ended it begins in its text, the tokens
    decoded as `BaseModel.decode` does; None when no stop string did); with
    `SampleRequest.topk_logprobs` k > 0, the k likeliest tokens at each sampled position
    and their logprobs (int32 / float32 `[n, k]`, most likely first)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    stop_reason: StopReason
    topk_token_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    stop_text_at: int | None = None


@dataclass(frozen=True)
class Generation:
    """A sample request's completions, how many of its prompt tokens came from the prefix
    cache instead of being computed (Tinker's `prompt_cache_hit_tokens`), and in how many
    decode slices of the pool it decoded (0: the static batch's)."""

    sequences: list[SampledSequence]
    prompt_cache_hit_tokens: int = 0
    decode_slices: int = 0


@dataclass(frozen=True)
class Progress:
    """A streamed sample request's rows so far (`SampleRequest.stream`), reported by a
    decode slice that ends with the request still decoding: each row's sequence drawn so
    far, in its samples' order (its logprobs and top-k as the answer will hold them; a
    row still decoding has `stop_reason` None). Its answer, a `Generation`, still comes
    when every row stops."""

    rows: list[SampledSequence]


@dataclass(frozen=True)
class SampleRequest:
    """Sample from a live adapter or an inflight target (`Engine.publish_inflight`), a saved
    sampler checkpoint, or (both None) the base."""

    adapter_id: str | None
    weights_path: str | None
    prompt: np.ndarray
    num_samples: int
    params: SamplingParams
    topk_logprobs: int = 0
    """k > 0: also the k likeliest tokens at every sampled position (Tinker's
    `topk_sample_logprobs`)."""
    cache_namespace: str = ""
    """The sampling session whose prompts may reuse each other's KV (`engine.sampling.pool`);
    '' reuses none. Never shared between tenants: a session belongs to one."""
    stream: bool = False
    """The decode pool reports its rows' tokens so far at the end of every slice it is
    still decoding in (`Progress`), before its answer."""

    @property
    def num_tokens(self) -> int:
        """Positions the request may occupy: every sample's prompt plus `max_tokens`. The
        one measure of a sample's size, for its limit and its share of a merged pass."""
        return self.num_samples * (self.prompt.size + self.params.max_tokens)


AUTO_PASS_TOKENS = -1
"""`EngineLimits.max_pass_tokens` for "pick by device and free memory" (`--max-pass-tokens 0`)."""
AUTO_SEQ_LEN = 0
"""`EngineLimits.max_seq_len` for "the model's context, bounded by the limits and memory"
(`--max-seq-len 0`, the default; `memory.auto_max_seq_len`)."""


@dataclass(frozen=True)
class EngineLimits:
    """Caps enforced before any compute; each violation is an `InvalidArgument` or
    `ResourceExhausted` naming the limit."""

    max_adapters: int = 32
    max_rank: int = 128
    max_seq_len: int = 4096
    max_batch_tokens: int = 262_144
    max_pass_tokens: int = 0
    """Most tokens the base runs in one piece of a pass (`forward.PassLogprobs`); 0: no
    cap; `AUTO_PASS_TOKENS`: picked by the engine (`memory.auto_pass_tokens`)."""
    kv_pool_tokens: int = 0
    """KV positions the decode pool holds (`engine.sampling.pool`); 0: picked from free memory
    (`memory.auto_kv_pool_tokens`), or none on an engine that does not sample."""
    memory_bytes: int = 0
    """What this engine may hold on its device (base weights, adapter state, KV pool, a
    pass), so several models can share one device; 0: no budget, what is free."""
