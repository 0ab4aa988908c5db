"""One adapter's whole state in one object: weights, optimizer, scheduler, loss, counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from twinkle_server.engine.lora import LoraWeights
from twinkle_server.engine.types import LoraSpec, LossSpec


@dataclass
class RunningMetrics:
    """Sums since the last `calculate_metric`, so the client sees averages over its steps."""

    loss_sum: float = 0.0
    batches: int = 0
    correct: float = 0.0
    tokens: float = 0.0

    def add(self, loss: float, correct: float, tokens: float) -> None:
        self.loss_sum += loss
        self.batches += 1
        self.correct += correct
        self.tokens += tokens


@dataclass
class Adapter:
    """A LoRA adapter being trained: everything the engine knows about it lives here.

    `weights` maps a targeted module name to its `LoraWeights` (the multi-LoRA layers
    reference the same objects). Gradient accumulation: `step()` counts `micro_step`
    and applies the optimizer only every `grad_accum` calls.
    """

    adapter_id: str
    spec: LoraSpec
    weights: dict[str, LoraWeights]
    grad_accum: int = 1
    optimizer: torch.optim.Optimizer | None = None
    optimizer_name: str = ""
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    scheduler: Any = None
    scheduler_name: str = ""
    scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    loss: LossSpec | None = None
    micro_step: int = 0
    step: int = 0
    tokens_seen: int = 0
    last_grad_norm: float = 0.0
    train_metrics: RunningMetrics = field(default_factory=RunningMetrics)
    eval_metrics: RunningMetrics = field(default_factory=RunningMetrics)

    def parameters(self) -> list[torch.nn.Parameter]:
        """Trainable tensors in a fixed order (module name, then A before B)."""
        return [p for name in sorted(self.weights)
                for p in (self.weights[name].lora_A, self.weights[name].lora_B)]

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def at_boundary(self) -> bool:
        """True when the next `step()` call applies the optimizer (or none is pending)."""
        return self.micro_step % self.grad_accum == 0

    @property
    def step_applies_next(self) -> bool:
        """True when the next `step()` completes an accumulation window (clip then)."""
        return (self.micro_step + 1) % self.grad_accum == 0

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def learning_rate(self) -> float:
        if self.optimizer is None:
            return 0.0
        return float(self.optimizer.param_groups[0]["lr"])
