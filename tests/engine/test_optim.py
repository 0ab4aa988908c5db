"""Optimizer and scheduler factories: allow-lists, kwarg checks, Tinker AdamW, clipping."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle_server.engine.errors import InvalidArgument
from twinkle_server.engine.optim import (
    apply_adam_params,
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    make_adamw,
)
from twinkle_server.engine.types import AdamParams


def _params():
    return [torch.nn.Parameter(torch.ones(3))]


def test_unknown_optimizer_and_scheduler_list_the_allowed_names():
    with pytest.raises(InvalidArgument, match=r"'Lion' is not allowed; choose one of \['Adam'"):
        build_optimizer("Lion", _params())
    opt = build_optimizer("SGD", _params(), lr=0.1)
    with pytest.raises(InvalidArgument, match="'StepLR' is not allowed"):
        build_scheduler("StepLR", opt)


def test_unknown_or_non_finite_kwargs_name_the_kwarg():
    with pytest.raises(InvalidArgument, match=r"optimizer.learning_rate: AdamW takes no"):
        build_optimizer("AdamW", _params(), learning_rate=1e-3)
    with pytest.raises(InvalidArgument, match="optimizer.lr: must be finite"):
        build_optimizer("AdamW", _params(), lr=float("inf"))
    opt = build_optimizer("AdamW", _params(), lr=1.0)
    with pytest.raises(InvalidArgument, match=r"lr_scheduler: CosineAnnealingLR needs \['T_max'\]"):
        build_scheduler("CosineAnnealingLR", opt)


def test_cosine_annealing_follows_the_closed_form_with_integral_float_kwargs():
    opt = build_optimizer("SGD", _params(), lr=1.0)
    sched = build_scheduler("CosineAnnealingLR", opt, T_max=10.0)
    for _ in range(4):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 10)))


def test_linear_warmup_scheduler_ramps_then_decays():
    opt = build_optimizer("SGD", _params(), lr=1.0)
    sched = build_scheduler("LinearWarmupScheduler", opt, num_warmup_steps=2,
                            num_training_steps=6)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.75])


def test_tinker_adamw_uses_exactly_the_given_hyper_parameters():
    opt = make_adamw(_params(), AdamParams(learning_rate=0.1, beta1=0.8, beta2=0.9, eps=1e-6,
                                           weight_decay=0.01))
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
        0.1, (0.8, 0.9), 1e-6, 0.01)
    apply_adam_params(opt, AdamParams(learning_rate=0.2))
    assert opt.param_groups[0]["lr"] == 0.2 and opt.param_groups[0]["betas"] == (0.9, 0.95)
    with pytest.raises(InvalidArgument, match="beta1: must be in"):
        apply_adam_params(opt, AdamParams(beta1=1.0))


def test_clip_grad_norm_returns_the_norm_before_clipping():
    params = _params()
    params[0].grad = torch.tensor([3.0, 4.0, 0.0])
    assert clip_grad_norm(params, 0.0) == pytest.approx(5.0)
    assert params[0].grad.tolist() == [3.0, 4.0, 0.0]
    assert clip_grad_norm(params, 1.0) == pytest.approx(5.0)
    assert float(params[0].grad.norm()) == pytest.approx(1.0, rel=1e-5)
