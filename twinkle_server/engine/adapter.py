"""One adapter's whole state in one object: weights, optimizer, scheduler, loss, counters,
and the optimizer verbs that change it (Tinker's `optim_step`, the native loop's
`set_optimizer` ... `lr_step`, `calculate_metric`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from twinkle_server.engine import optim
from twinkle_server.engine.errors import FailedPrecondition
from twinkle_server.engine.lora import LoraWeights
from twinkle_server.engine.types import AdamParams, LoraSpec, LossSpec


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

    def restart_optimizer(self) -> None:
        """Start the optimizer's state again, its settings kept: moments and step counts
        gone, the lr back to where the schedule starts (a new scheduler on it), the
        counters at 0. What a weights-only load leaves (the SDK's "optimizer resets"), so
        the run steps as a new adapter set up alike and loading the same weights would."""
        self.step = self.micro_step = 0
        if self.optimizer is None:
            return
        self.optimizer.state.clear()
        for group in self.optimizer.param_groups:
            group["lr"] = group.get("initial_lr", group["lr"])
        if self.scheduler_name:
            self.scheduler = optim.build_scheduler(self.scheduler_name, self.optimizer,
                                                   **self.scheduler_kwargs)

    def learning_rate(self) -> float:
        if self.optimizer is None:
            return 0.0
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ Tinker optimizer

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        """AdamW with exactly `params`, optional clipping, then zero the gradients."""
        if self.optimizer is None:
            self.optimizer = optim.make_adamw(self.parameters(), params)
            self.optimizer_name = "AdamW"
        elif not isinstance(self.optimizer, torch.optim.AdamW):
            raise FailedPrecondition(f"optim_step: the adapter uses {self.optimizer_name} "
                                     "(set_optimizer); optim_step needs AdamW")
        optim.apply_adam_params(self.optimizer, params)
        norm = optim.clip_grad_norm(self.parameters(), params.grad_clip_norm)
        self.optimizer.step()
        self.zero_grad()
        self.step += 1
        self.last_grad_norm = norm
        return {"grad_norm": norm, "learning_rate": params.learning_rate,
                "step": float(self.step)}

    # ------------------------------------------------------------------ native loop

    def set_optimizer(self, name: str, kwargs: dict[str, Any]) -> None:
        """Replace the optimizer (allow-listed `name`); a set scheduler is rebuilt on it."""
        self.optimizer = optim.build_optimizer(name, self.parameters(), **kwargs)
        self.optimizer_name, self.optimizer_kwargs = name, dict(kwargs)
        if self.scheduler_name:
            self.scheduler = optim.build_scheduler(self.scheduler_name, self.optimizer,
                                                   **self.scheduler_kwargs)

    def set_lr_scheduler(self, name: str, kwargs: dict[str, Any]) -> None:
        """Schedule the optimizer's lr (allow-listed `name`); needs `set_optimizer` first."""
        if self.optimizer is None:
            raise FailedPrecondition("lr_scheduler: call set_optimizer first")
        self.scheduler = optim.build_scheduler(name, self.optimizer, **kwargs)
        self.scheduler_name, self.scheduler_kwargs = name, dict(kwargs)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip when the next `step` applies the optimizer; mid-window only measure, so a
        window's gradients are clipped once, as one big batch's would be."""
        optim.check_max_norm(max_norm)
        if not self.step_applies_next:
            return optim.grad_norm(self.parameters())
        self.last_grad_norm = optim.clip_grad_norm(self.parameters(), max_norm)
        return self.last_grad_norm

    def step_optimizer(self) -> dict[str, float]:
        """The native `step()`: count a micro-step; every `grad_accum`-th applies the
        optimizer."""
        if self.optimizer is None:
            raise FailedPrecondition("step: no optimizer; call set_optimizer first")
        self.micro_step += 1
        applied = self.at_boundary
        if applied:
            self.optimizer.step()
            self.step += 1
        return {"applied": float(applied), "step": float(self.step),
                "micro_step": float(self.micro_step)}

    def zero_grad_at_boundary(self) -> None:
        """The native `zero_grad()`: clears only at a window boundary, so the window's
        micro-batches keep accumulating."""
        if self.at_boundary:
            self.zero_grad()

    def lr_step(self) -> None:
        """Advance the scheduler once per applied optimizer step (not per micro-step)."""
        if self.scheduler is not None and self.at_boundary and self.micro_step:
            self.scheduler.step()

    def calculate_metric(self, is_training: bool = True) -> dict[str, float]:
        """Averages since the last call (then reset), plus the adapter's counters."""
        book = self.train_metrics if is_training else self.eval_metrics
        out = {
            "loss": book.loss_sum / book.batches if book.batches else float("nan"),
            "token_accuracy": book.correct / book.tokens if book.tokens else float("nan"),
            "grad_norm": self.last_grad_norm,
            "lr": self.learning_rate(),
            "tokens_seen": float(self.tokens_seen),
            "steps": float(self.step),
        }
        book.__init__()
        return out

    def train_configs(self) -> dict[str, Any]:
        """LoRA shape, optimizer, scheduler, loss and counters, as plain values."""
        return {
            "lora": {**asdict(self.spec), "target_modules": sorted(self.weights)},
            "optimizer": {"name": self.optimizer_name, "kwargs": self.optimizer_kwargs},
            "lr_scheduler": {"name": self.scheduler_name, "kwargs": self.scheduler_kwargs},
            "loss": asdict(self.loss) if self.loss else None,
            "gradient_accumulation_steps": self.grad_accum,
            "step": self.step, "micro_step": self.micro_step,
            "tokens_seen": self.tokens_seen,
        }
