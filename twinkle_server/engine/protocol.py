"""What the runtime may call on an engine, and which calls every rank must make.

`EngineAPI` is the engine as the runtime, the scheduler's executor and the server see
it. Two classes implement it, each method written out:

- `engine.Engine`, the in-process engine (one rank, or one of several);
- `twinkle_server.ranks.replication.ReplicatedEngine`, rank 0's engine when the server runs on
  several ranks: it sends each replicated call to every rank before running it itself.

Each public method of `Engine` is declared once, where it is defined, as one of:

- `@replicated`: it changes adapter or sampler state, or runs the base (whose collectives
  every rank must join), so every rank runs it, in the same order (`REPLICATED`);
- `@rank_zero_only`: it reads state that is the same on every rank (adapter info, limits,
  request checks) or writes files from it (saves), so rank 0 alone runs it (`RANK_ZERO_ONLY`).

`tests/engine/test_protocol.py` fails when a public method of `Engine` carries neither
mark, when `EngineAPI` and `Engine` disagree, or when `ReplicatedEngine` sends a call
that is not replicated or keeps one that is on rank 0.

This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import os

    import numpy as np

    from twinkle_server.engine.adapter import Adapter
    from twinkle_server.engine.base_model import BaseModel
    from twinkle_server.engine.errors import EngineError
    from twinkle_server.engine.residency import PagingStats
    from twinkle_server.engine.sampling.book import PoolStats
    from twinkle_server.engine.types import (
        AdamParams,
        EngineLimits,
        ForwardOutput,
        ForwardRequest,
        Generation,
        LoraSpec,
        LossSpec,
        Progress,
        SampledSequence,
        SampleRequest,
    )

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "__twinkle_ranks__"
_REPLICATED, _RANK_ZERO_ONLY = "replicated", "rank_zero_only"


def replicated(method: F) -> F:
    """Marks an `Engine` method that every rank runs, in the same order: it changes
    adapter or sampler state, or runs the base."""
    return _mark(method, _REPLICATED)


def rank_zero_only(method: F) -> F:
    """Marks an `Engine` method that rank 0 alone runs: it changes no engine state (reads,
    request checks, saves of state that every rank holds alike)."""
    return _mark(method, _RANK_ZERO_ONLY)


def _mark(method: F, kind: str) -> F:
    target = method.__func__ if isinstance(method, (staticmethod, classmethod)) else method
    if getattr(target, _MARK, kind) != kind:
        raise TypeError(f"{target.__qualname__}: marked both replicated and rank_zero_only")
    setattr(target, _MARK, kind)
    return method


def ranks_of(method: Any) -> str | None:
    """'replicated', 'rank_zero_only', or None for an unmarked method."""
    return getattr(getattr(method, "__func__", method), _MARK, None)


def marked(cls: type, kind: str) -> frozenset[str]:
    """The names of `cls`'s methods marked `kind` ('replicated' or 'rank_zero_only')."""
    return frozenset(name for name in dir(cls)
                     if not name.startswith("_") and ranks_of(getattr(cls, name)) == kind)


class EngineAPI(Protocol):
    """One frozen base, many LoRA adapters: the calls the runtime makes (see the module
    docstring for which run on every rank)."""

    @property
    def base(self) -> BaseModel: ...

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def adapters(self) -> Mapping[str, Adapter]: ...

    # ------------------------------------------------------------------ adapters
    def paging_stats(self) -> PagingStats: ...

    def estimate_adapter_bytes(self, spec: LoraSpec) -> int: ...

    def add_adapter(self, adapter_id: str, spec: LoraSpec,
                    gradient_accumulation_steps: int = 1, owner: str = "") -> dict[str, Any]: ...

    def adapter_info(self, adapter_id: str) -> dict[str, Any]: ...

    def remove_adapter(self, adapter_id: str) -> None: ...

    # ------------------------------------------------------------------ forward
    def check_forward(self, request: ForwardRequest) -> None: ...

    def validate_forward(self, request: ForwardRequest) -> LossSpec: ...

    def forward_batch(self, requests: Sequence[ForwardRequest]
                      ) -> list[ForwardOutput | EngineError]: ...

    # ------------------------------------------------------------------ optimizer verbs
    def optim_step(self, adapter_id: str, params: AdamParams) -> dict[str, float]: ...

    def set_loss(self, adapter_id: str, loss: LossSpec) -> None: ...

    def set_optimizer(self, adapter_id: str, name: str, kwargs: dict[str, Any]) -> None: ...

    def set_lr_scheduler(self, adapter_id: str, name: str, kwargs: dict[str, Any]) -> None: ...

    def clip_grad_norm(self, adapter_id: str, max_norm: float) -> float: ...

    def step(self, adapter_id: str) -> dict[str, float]: ...

    def zero_grad(self, adapter_id: str) -> None: ...

    def lr_step(self, adapter_id: str) -> None: ...

    def calculate_metric(self, adapter_id: str, is_training: bool = True
                         ) -> dict[str, float]: ...

    def get_train_configs(self, adapter_id: str) -> dict[str, Any]: ...

    # ------------------------------------------------------------------ checkpoints
    def save_weights(self, adapter_id: str, path: str | Path, overwrite: bool = False
                     ) -> int: ...

    def save_state(self, adapter_id: str, path: str | Path, include_optimizer: bool = True,
                   overwrite: bool = False) -> int: ...

    def read_checkpoint_spec(self, path: str | Path) -> LoraSpec: ...

    def load_state(self, adapter_id: str, path: str | Path, include_optimizer: bool,
                   adopt_accumulation: bool = False) -> None: ...

    # ------------------------------------------------------------------ sampling
    def has_sampler(self, weights_path: str | os.PathLike) -> bool: ...

    def sampler_dirs(self) -> set[str]: ...

    def sample_batch(self, requests: Sequence[SampleRequest]
                     ) -> list[list[SampledSequence] | EngineError]: ...

    def decode(self, requests: Sequence[SampleRequest], keys: Sequence[int], slice_s: float,
               cancelled: Sequence[int] = ()
               ) -> list[tuple[int, Generation | EngineError | Progress]]: ...

    def decode_stats(self) -> PoolStats: ...

    def publish_inflight(self, adapter_id: str) -> str: ...

    def compute_logprobs(self, adapter_id: str | None, weights_path: str | None,
                         tokens: np.ndarray) -> np.ndarray: ...

    def prompt_logprobs(self, adapter_id: str | None, weights_path: str | None,
                        tokens: np.ndarray, topk: int = 0) -> Any: ...

    def score_prompt(self, adapter_id: str | None, weights_path: str | None,
                     tokens: np.ndarray, scoring: Any) -> Any: ...
