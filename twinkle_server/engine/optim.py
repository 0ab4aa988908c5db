"""Optimizers and learning-rate schedulers an adapter may use, by name, from an allow-list.

Tinker's `optim_step(AdamParams)` is `torch.optim.AdamW` with exactly those
hyper-parameters (decoupled weight decay), written onto every parameter group before each
step. The native client picks a class and kwargs by name; kwargs are checked against the
class's signature so a typo is an `InvalidArgument` that names it, never a `TypeError` from
deep inside torch. Kwargs arrive from JSON, so an integral float (`T_max=10.0`) is accepted
for an `int` parameter and a list for a tuple one (`betas=[0.9, 0.99]`).

Schedulers: torch's `LinearLR`, `CosineAnnealingLR`, `ConstantLR` (torch semantics: a
factor for `total_iters` steps, default 1/3 for 5), transformers'
`get_cosine_schedule_with_warmup` as `CosineWarmupScheduler(num_warmup_steps,
num_training_steps, num_cycles=0.5)` and `get_linear_schedule_with_warmup` as
`LinearWarmupScheduler(num_warmup_steps, num_training_steps)`, and `constant` (factor 1).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.types import AdamParams

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "AdamW": torch.optim.AdamW,
    "Adam": torch.optim.Adam,
    "SGD": torch.optim.SGD,
}


def _cosine_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                   num_training_steps: int, num_cycles: float = 0.5
                   ) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 to the base lr, then cosine decay over `num_cycles` periods."""
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps,
                                           num_cycles)


def _linear_warmup(optimizer: torch.optim.Optimizer, num_warmup_steps: int,
                   num_training_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 to the base lr, then linear decay to 0 at num_training_steps."""
    from transformers import get_linear_schedule_with_warmup

    return get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps)


def _one(_: int) -> float:
    return 1.0


def _constant(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """The base lr at every step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _one)


_SCHEDULERS: dict[str, Callable[..., torch.optim.lr_scheduler.LRScheduler]] = {
    "LinearLR": torch.optim.lr_scheduler.LinearLR,
    "CosineAnnealingLR": torch.optim.lr_scheduler.CosineAnnealingLR,
    "ConstantLR": torch.optim.lr_scheduler.ConstantLR,
    "CosineWarmupScheduler": _cosine_warmup,
    "LinearWarmupScheduler": _linear_warmup,
    "constant": _constant,
}
SCHEDULERS: frozenset[str] = frozenset(_SCHEDULERS)
# A period of 0 steps divides by zero at the first step, long after the call that set it.
_POSITIVE_INTS = frozenset({"T_max"})
_SKIPPED_PARAMS = frozenset({"self", "params", "optimizer"})


def _kind(param: inspect.Parameter) -> str:
    """'int', 'bool', 'float', 'tuple' or 'other', from the annotation, else the default."""
    ann = param.annotation
    text = ann if isinstance(ann, str) else inspect.formatannotation(ann)
    if ann is not inspect.Parameter.empty:
        if text == "int":
            return "int"
        if text.startswith("bool"):
            return "bool"
        if text.startswith("tuple"):
            return "tuple"
        if text.startswith("float"):
            return "float"
    default = param.default
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    if isinstance(default, tuple):
        return "tuple"
    return "other"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _coerce(field: str, param: inspect.Parameter, value: Any) -> Any:
    """One kwarg converted to what the parameter takes, or InvalidArgument naming it."""
    kind = _kind(param)
    if value is None:
        if param.default is None:
            return None
        raise InvalidArgument(f"{field}: must not be null")
    if kind == "bool":
        if not isinstance(value, bool):
            raise InvalidArgument(f"{field}: must be true or false, got {value!r}")
        return value
    if kind == "tuple":
        if not isinstance(value, (list, tuple)) or not all(_is_number(v) for v in value):
            raise InvalidArgument(f"{field}: must be a list of numbers, got {value!r}")
        if not all(math.isfinite(v) for v in value):
            raise InvalidArgument(f"{field}: must be finite, got {list(value)}")
        return tuple(float(v) for v in value)
    if kind in ("int", "float"):
        if not _is_number(value):
            raise InvalidArgument(f"{field}: must be a number, got {value!r}")
        if not math.isfinite(value):
            raise InvalidArgument(f"{field}: must be finite, got {value}")
        if kind == "int":
            if float(value) != int(value):
                raise InvalidArgument(f"{field}: must be an integer, got {value}")
            return int(value)
        return float(value)
    return value


def _check_kwargs(what: str, name: str, target: Callable[..., Any], kwargs: dict[str, Any]
                  ) -> dict[str, Any]:
    """Kwargs checked against `target`'s signature: unknown, missing, mistyped, non-finite."""
    params = {k: p for k, p in inspect.signature(target).parameters.items()
              if k not in _SKIPPED_PARAMS
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    clean: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key not in params:
            raise InvalidArgument(
                f"{what}.{key}: {name} takes no argument {key!r}; it takes {list(params)}")
        clean[key] = _coerce(f"{what}.{key}", params[key], value)
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty
               and k not in clean]
    if missing:
        raise InvalidArgument(f"{what}: {name} needs {missing}")
    return clean


def _construct(what: str, name: str, factory: Callable[..., Any], *args: Any,
               **kwargs: Any) -> Any:
    """Call the torch/transformers constructor; its own range checks become InvalidArgument."""
    try:
        return factory(*args, **kwargs)
    except (TypeError, ValueError, KeyError, RuntimeError) as exc:
        raise InvalidArgument(f"{what}: {name}({kwargs}) was rejected: {exc}") from exc


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], **kwargs: Any
                    ) -> torch.optim.Optimizer:
    """An optimizer from the allow-list (`AdamW`, `Adam`, `SGD`) with validated kwargs.

    Raises InvalidArgument for a name off the list (listing it), an unknown kwarg (naming
    it), a value of the wrong type, a non-finite number or a negative `lr`.
    """
    if name not in OPTIMIZERS:
        raise InvalidArgument(f"optimizer: {name!r} is not allowed; choose one of "
                              f"{sorted(OPTIMIZERS)}")
    cls = OPTIMIZERS[name]
    clean = _check_kwargs("optimizer", name, cls.__init__, kwargs)
    if clean.get("lr", 0.0) < 0:
        raise InvalidArgument(f"optimizer.lr: must be >= 0, got {clean['lr']}")
    if "eps" in clean:
        _check_eps("optimizer.eps", clean["eps"])
    return _construct("optimizer", name, cls, list(params), **clean)


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, **kwargs: Any
                    ) -> torch.optim.lr_scheduler.LRScheduler:
    """A learning-rate scheduler from the allow-list (`SCHEDULERS`) with validated kwargs.

    Step counts must be >= 0 (`T_max` >= 1); other errors as for `build_optimizer`.
    """
    if name not in _SCHEDULERS:
        raise InvalidArgument(f"lr_scheduler: {name!r} is not allowed; choose one of "
                              f"{sorted(SCHEDULERS)}")
    factory = _SCHEDULERS[name]
    target = factory.__init__ if inspect.isclass(factory) else factory
    clean = _check_kwargs("lr_scheduler", name, target, kwargs)
    for key, value in clean.items():
        if key == "last_epoch" or isinstance(value, bool) or not isinstance(value, int):
            continue
        low = 1 if key in _POSITIVE_INTS else 0
        if value < low:
            raise InvalidArgument(f"lr_scheduler.{key}: must be >= {low}, got {value}")
    return _construct("lr_scheduler", name, factory, optimizer, **clean)


def _check_eps(field: str, eps: float) -> None:
    """Adam's eps keeps its update's denominator above 0: at 0, a parameter whose
    gradients have all been 0 (a fresh adapter's lora_A: lora_B starts at 0) steps by
    0/0 = NaN, and the adapter is lost."""
    if eps <= 0:
        raise InvalidArgument(f"{field}: must be > 0, got {eps}")


def _check_adam(adam: AdamParams) -> None:
    for key in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(adam, key)
        if not math.isfinite(value):
            raise InvalidArgument(f"adam_params.{key}: must be finite, got {value}")
    for key in ("learning_rate", "weight_decay", "grad_clip_norm"):
        if getattr(adam, key) < 0:
            raise InvalidArgument(f"adam_params.{key}: must be >= 0, got {getattr(adam, key)}")
    _check_eps("adam_params.eps", adam.eps)
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(adam, key) < 1.0:
            raise InvalidArgument(f"adam_params.{key}: must be in [0, 1), got {getattr(adam, key)}")


def make_adamw(params: Iterable[torch.nn.Parameter], adam: AdamParams) -> torch.optim.AdamW:
    """Tinker's optimizer: AdamW with exactly these hyper-parameters."""
    _check_adam(adam)
    return torch.optim.AdamW(list(params), lr=adam.learning_rate, betas=(adam.beta1, adam.beta2),
                             eps=adam.eps, weight_decay=adam.weight_decay)


def apply_adam_params(optimizer: torch.optim.Optimizer, adam: AdamParams) -> None:
    """Set this step's lr, betas, eps and weight decay on every parameter group.

    Tinker sends the hyper-parameters with every `optim_step`, so a schedule computed by
    the client takes effect at once; Adam's moment estimates are kept.
    """
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
    norms = torch.stack([torch.linalg.vector_norm(g.detach().float()).cpu() for g in grads])
    return float(torch.linalg.vector_norm(norms))


def check_max_norm(max_norm: float) -> None:
    """A clipping cap: a finite number >= 0 (0 only measures; below 0 would cap
    nothing)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
            or not math.isfinite(max_norm):
        raise InvalidArgument(f"max_norm: must be a finite number, got {max_norm!r}")
    if max_norm < 0:
        raise InvalidArgument(f"max_norm: must be >= 0 (0 only measures), got {max_norm}")


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Scale the gradients so their total L2 norm is at most `max_norm`; returns the norm
    before clipping. `max_norm` 0 only measures (Tinker's `grad_clip_norm` 0 = off); below
    0 is refused (it caps nothing)."""
    params = list(params)
    check_max_norm(max_norm)
    if max_norm == 0:
        return grad_norm(params)
    if not any(p.grad is not None for p in params):
        return 0.0
    return float(torch.nn.utils.clip_grad_norm_(params, float(max_norm)))
