"""Optimizers and learning-rate schedulers an adapter may use, by name, from an allow-list.

Tinker's `optim_step(AdamParams)` is `torch.optim.AdamW` with exactly those
hyper-parameters (decoupled weight decay), updated before every step. The native client
picks a class and kwargs by name; kwargs are checked against the class's signature so a
typo is an error that names it, not a `TypeError` from deep inside torch.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import Any

import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import AdamParams

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "AdamW": torch.optim.AdamW,
    "Adam": torch.optim.Adam,
    "SGD": torch.optim.SGD,
}


def _cosine_warmup(optimizer, num_warmup_steps: int, num_training_steps: int,
                   num_cycles: float = 0.5):
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps,
                                           num_cycles)


def _linear_warmup(optimizer, num_warmup_steps: int, num_training_steps: int):
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps)


def _constant(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


_SCHEDULERS: dict[str, Any] = {
    "LinearLR": torch.optim.lr_scheduler.LinearLR,
    "CosineAnnealingLR": torch.optim.lr_scheduler.CosineAnnealingLR,
    "ConstantLR": torch.optim.lr_scheduler.ConstantLR,
    "CosineWarmupScheduler": _cosine_warmup,
    "LinearWarmupScheduler": _linear_warmup,
    "constant": _constant,
}
SCHEDULERS = frozenset(_SCHEDULERS)


def _check_kwargs(what: str, name: str, target: Any, kwargs: dict[str, Any],
                  skip: tuple[str, ...]) -> dict[str, Any]:
    params = inspect.signature(target).parameters
    accepted = [p for p in params if p not in skip]
    clean: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key not in accepted:
            raise InvalidArgument(
                f"{what}.{key}: {name} takes no argument {key!r}; it takes {accepted}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            clean[key] = value
            continue
        if not math.isfinite(float(value)):
            raise InvalidArgument(f"{what}.{key}: must be finite, got {value}")
        default = params[key].default
        # JSON numbers arrive as floats; integral ones go to int parameters as ints.
        if isinstance(value, float) and value.is_integer() and isinstance(default, int):
            value = int(value)
        clean[key] = value
    required = [p for p, v in params.items() if p not in skip and v.default is inspect._empty
                and v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY)]
    missing = [p for p in required if p not in clean]
    if missing:
        raise InvalidArgument(f"{what}: {name} needs {missing}")
    return clean


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], **kwargs: Any
                    ) -> torch.optim.Optimizer:
    """An optimizer from the allow-list (`AdamW`, `Adam`, `SGD`) with validated kwargs."""
    if name not in OPTIMIZERS:
        raise InvalidArgument(f"optimizer: {name!r} is not allowed; choose one of "
                              f"{sorted(OPTIMIZERS)}")
    cls = OPTIMIZERS[name]
    clean = _check_kwargs("optimizer", name, cls.__init__, kwargs, ("self", "params"))
    lr = clean.get("lr", 1e-3)
    if isinstance(lr, (int, float)) and lr < 0:
        raise InvalidArgument(f"optimizer.lr: must be >= 0, got {lr}")
    return cls(list(params), **clean)


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, **kwargs: Any
                    ) -> torch.optim.lr_scheduler.LRScheduler:
    """A learning-rate scheduler from the allow-list with validated kwargs."""
    if name not in _SCHEDULERS:
        raise InvalidArgument(f"lr_scheduler: {name!r} is not allowed; choose one of "
                              f"{sorted(SCHEDULERS)}")
    factory = _SCHEDULERS[name]
    target = factory.__init__ if inspect.isclass(factory) else factory
    clean = _check_kwargs("lr_scheduler", name, target, kwargs, ("self", "optimizer"))
    return factory(optimizer, **clean)


def _check_adam(adam: AdamParams) -> None:
    for key in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(adam, key)
        if not math.isfinite(value):
            raise InvalidArgument(f"adam_params.{key}: must be finite, got {value}")
    if adam.learning_rate < 0 or adam.eps < 0 or adam.weight_decay < 0:
        raise InvalidArgument("adam_params: learning_rate, eps and weight_decay must be >= 0")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(adam, key) < 1.0:
            raise InvalidArgument(f"adam_params.{key}: must be in [0, 1), got {getattr(adam, key)}")


def make_adamw(params: Iterable[torch.nn.Parameter], adam: AdamParams) -> torch.optim.AdamW:
    """Tinker's optimizer: AdamW with exactly these hyper-parameters."""
    _check_adam(adam)
    return torch.optim.AdamW(list(params), lr=adam.learning_rate, betas=(adam.beta1, adam.beta2),
                             eps=adam.eps, weight_decay=adam.weight_decay)


def apply_adam_params(optimizer: torch.optim.Optimizer, adam: AdamParams) -> None:
    """Set this step's hyper-parameters on every parameter group."""
    _check_adam(adam)
    for group in optimizer.param_groups:
        group["lr"] = adam.learning_rate
        group["betas"] = (adam.beta1, adam.beta2)
        group["eps"] = adam.eps
        group["weight_decay"] = adam.weight_decay


def grad_norm(params: Iterable[torch.nn.Parameter]) -> float:
    """Total L2 norm of the gradients (parameters without a gradient count as zero)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip to `max_norm` (<= 0: only measure); returns the norm before clipping."""
    params = list(params)
    if not math.isfinite(max_norm):
        raise InvalidArgument(f"max_norm: must be finite, got {max_norm}")
    if max_norm <= 0:
        return grad_norm(params)
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
