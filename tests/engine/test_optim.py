"""Optimizer and scheduler factories: allow-lists, kwarg checks, Tinker AdamW, clipping.

Scheduler values are checked against their closed forms written out here.
"""

from __future__ import annotations

import math

import pytest
import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.optim import (
    OPTIMIZERS,
    SCHEDULERS,
    apply_adam_params,
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    grad_norm,
    make_adamw,
)
from twinkle_server.engine.types import AdamParams


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


def _lrs(name, steps, **kwargs):
    """The lr in effect at steps 0..steps-1 with base lr 1."""
    opt = build_optimizer("SGD", _params(), lr=1.0)
    sched = build_scheduler(name, opt, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_allow_lists_hold_the_documented_names():
    assert set(OPTIMIZERS) == {"AdamW", "Adam", "SGD"}
    assert SCHEDULERS == {"LinearLR", "CosineAnnealingLR", "CosineWarmupScheduler",
                          "LinearWarmupScheduler", "ConstantLR", "constant"}


def test_unknown_optimizer_and_scheduler_list_the_allowed_names():
    with pytest.raises(InvalidArgument, match=r"'Lion' is not allowed; choose one of "
                                              r"\['Adam', 'AdamW', 'SGD'\]"):
        build_optimizer("Lion", _params())
    opt = build_optimizer("SGD", _params(), lr=0.1)
    with pytest.raises(InvalidArgument, match=r"'StepLR' is not allowed; choose one of "
                                              r"\['ConstantLR', 'CosineAnnealingLR'"):
        build_scheduler("StepLR", opt)


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("AdamW", {"learning_rate": 1e-3}, r"optimizer.learning_rate: AdamW takes no argument"),
    ("SGD", {"betas": [0.9, 0.9]}, r"optimizer.betas: SGD takes no argument 'betas'; it takes"),
    ("AdamW", {"lr": float("inf")}, "optimizer.lr: must be finite"),
    ("AdamW", {"lr": float("nan")}, "optimizer.lr: must be finite"),
    ("Adam", {"lr": -1e-3}, r"optimizer.lr: must be >= 0, got -0.001"),
    ("AdamW", {"lr": "1e-3"}, "optimizer.lr: must be a number"),
    ("AdamW", {"lr": True}, "optimizer.lr: must be a number"),
    ("AdamW", {"amsgrad": "yes"}, "optimizer.amsgrad: must be true or false"),
    ("AdamW", {"betas": 0.9}, "optimizer.betas: must be a list of numbers"),
    ("AdamW", {"betas": [0.9, float("nan")]}, "optimizer.betas: must be finite"),
    ("Adam", {"lr": 0.1, "eps": 0.0}, r"optimizer.eps: must be > 0, got 0.0"),
    # torch's own range check (a ValueError) comes back as InvalidArgument.
    ("AdamW", {"betas": [1.5, 0.9]}, r"optimizer: AdamW\(.*\) was rejected: .*beta"),
    ("SGD", {"lr": 0.1, "momentum": -1.0}, "optimizer: SGD.*was rejected"),
])
def test_bad_optimizer_kwargs_raise_invalid_argument_naming_the_kwarg(name, kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        build_optimizer(name, _params(), **kwargs)


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("CosineAnnealingLR", {}, r"lr_scheduler: CosineAnnealingLR needs \['T_max'\]"),
    ("CosineAnnealingLR", {"T_max": 10, "warmup": 2},
     r"lr_scheduler.warmup: CosineAnnealingLR takes no argument 'warmup'"),
    ("CosineAnnealingLR", {"T_max": 10.5}, "lr_scheduler.T_max: must be an integer, got 10.5"),
    ("CosineAnnealingLR", {"T_max": 0}, r"lr_scheduler.T_max: must be >= 1, got 0"),
    ("LinearWarmupScheduler", {"num_warmup_steps": -1, "num_training_steps": 5},
     "lr_scheduler.num_warmup_steps: must be >= 0"),
    ("CosineWarmupScheduler", {"num_warmup_steps": 1},
     r"CosineWarmupScheduler needs \['num_training_steps'\]"),
    ("LinearLR", {"start_factor": 2.0}, r"lr_scheduler: LinearLR\(.*\) was rejected"),
    ("constant", {"factor": 0.5}, "lr_scheduler.factor: constant takes no argument"),
])
def test_bad_scheduler_kwargs_raise_invalid_argument_naming_the_kwarg(name, kwargs, message):
    opt = build_optimizer("SGD", _params(), lr=1.0)
    with pytest.raises(InvalidArgument, match=message):
        build_scheduler(name, opt, **kwargs)


def test_json_shaped_kwargs_are_converted_to_the_parameter_types():
    opt = build_optimizer("AdamW", _params(), lr=1, betas=[0.8, 0.9], weight_decay=0)
    group = opt.param_groups[0]
    assert group["betas"] == (0.8, 0.9) and isinstance(group["lr"], float)
    sched = build_scheduler("LinearWarmupScheduler", opt, num_warmup_steps=2.0,
                            num_training_steps=6.0)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)


def test_cosine_annealing_follows_the_closed_form_with_integral_float_kwargs():
    lrs = _lrs("CosineAnnealingLR", 11, T_max=10.0, eta_min=0.1)
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * n / 10)) for n in range(11)]
    assert lrs == pytest.approx(expected)


def test_linear_lr_ramps_the_factor_then_holds():
    lrs = _lrs("LinearLR", 7, start_factor=0.5, end_factor=1.0, total_iters=4)
    assert lrs == pytest.approx([0.5 + 0.5 * min(n, 4) / 4 for n in range(7)])


def test_constant_lr_uses_torch_semantics_and_constant_is_flat():
    assert _lrs("ConstantLR", 7) == pytest.approx([1 / 3] * 5 + [1.0, 1.0])
    assert _lrs("constant", 4) == [1.0] * 4


def test_linear_warmup_scheduler_ramps_then_decays_to_zero():
    assert _lrs("LinearWarmupScheduler", 7, num_warmup_steps=2, num_training_steps=6) \
        == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0])


@pytest.mark.parametrize("cycles", [0.5, 1.0])
def test_cosine_warmup_scheduler_matches_the_closed_form(cycles):
    warm, total = 3, 11
    kwargs = {"num_warmup_steps": warm, "num_training_steps": total}
    if cycles != 0.5:
        kwargs["num_cycles"] = cycles

    def closed(n):
        if n < warm:
            return n / warm
        progress = (n - warm) / (total - warm)
        return max(0.0, 0.5 * (1 + math.cos(math.pi * 2 * cycles * progress)))

    assert _lrs("CosineWarmupScheduler", total + 1, **kwargs) == pytest.approx(
        [closed(n) for n in range(total + 1)])


def test_tinker_adamw_step_uses_exactly_the_given_hyper_parameters():
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    adam = AdamParams(learning_rate=0.1, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.01)
    opt = make_adamw([param], adam)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        0.1, (0.8, 0.9), 1e-6, 0.01)
    param.grad = torch.tensor([0.5, 0.25])
    opt.step()
    # First AdamW step: bias-corrected m/sqrt(v) = g/|g|; weight decay is decoupled.
    g, p0 = torch.tensor([0.5, 0.25]), torch.tensor([1.0, -2.0])
    expected = p0 * (1 - 0.1 * 0.01) - 0.1 * g / (g.abs() + 1e-6)
    torch.testing.assert_close(param.detach(), expected)


def test_apply_adam_params_sets_every_group_and_keeps_the_moments():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([{"params": [a]}, {"params": [b], "lr": 5.0}])
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    opt.step()
    moments = opt.state[a]["exp_avg"].clone()
    apply_adam_params(opt, AdamParams(learning_rate=0.2, beta1=0.5, beta2=0.6, eps=1e-3,
                                      weight_decay=0.1))
    for group in opt.param_groups:
        assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
            0.2, (0.5, 0.6), 1e-3, 0.1)
    torch.testing.assert_close(opt.state[a]["exp_avg"], moments)


@pytest.mark.parametrize(("adam", "message"), [
    (AdamParams(beta1=1.0), r"adam_params.beta1: must be in \[0, 1\)"),
    (AdamParams(learning_rate=-1e-4), "adam_params.learning_rate: must be >= 0"),
    (AdamParams(eps=float("nan")), "adam_params.eps: must be finite"),
    (AdamParams(weight_decay=float("inf")), "adam_params.weight_decay: must be finite"),
    # 0 divides a zero moment by zero: a fresh adapter's lora_A gradient is exactly 0.
    (AdamParams(eps=0.0), r"adam_params.eps: must be > 0, got 0.0"),
])
def test_bad_adam_params_are_rejected_naming_the_field(adam, message):
    with pytest.raises(InvalidArgument, match=message):
        make_adamw(_params(), adam)
    opt = make_adamw(_params(), AdamParams())
    with pytest.raises(InvalidArgument, match=message):
        apply_adam_params(opt, adam)


def test_clip_grad_norm_returns_the_norm_before_clipping():
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 1, 4))
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # c has no gradient
    params = [a, b, c]
    assert grad_norm(params) == pytest.approx(5.0)
    assert clip_grad_norm(params, 0.0) == pytest.approx(5.0)  # 0 only measures
    assert a.grad.tolist() == [3.0, 0.0] and b.grad.tolist() == [4.0]
    assert clip_grad_norm(params, 10.0) == pytest.approx(5.0)  # under the cap: unchanged
    assert b.grad.tolist() == [4.0]
    assert clip_grad_norm(params, 1.0) == pytest.approx(5.0)
    assert grad_norm(params) == pytest.approx(1.0, rel=1e-5)
    assert a.grad.tolist() == pytest.approx([0.6, 0.0], rel=1e-5)


def test_clip_grad_norm_without_gradients_is_zero_and_rejects_a_non_finite_cap():
    assert clip_grad_norm(_params(), 1.0) == 0.0
    assert grad_norm(_params()) == 0.0
    with pytest.raises(InvalidArgument, match="max_norm: must be a finite number"):
        clip_grad_norm(_params(), float("nan"))


def test_a_negative_clip_cap_is_refused_and_leaves_the_gradients():
    """A cap below 0 caps nothing (torch's own would flip the gradients' sign); once it
    was read as "only measure", the user's clipping silently off."""
    a = torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([3.0, 4.0])
    with pytest.raises(InvalidArgument, match=r"max_norm: must be >= 0 \(0 only measures\)"):
        clip_grad_norm([a], -1.0)
    assert a.grad.tolist() == [3.0, 4.0]
