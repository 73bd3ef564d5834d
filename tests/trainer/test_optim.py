"""Schedule numbers and the fp64 gradient norm."""

from __future__ import annotations

import math

import pytest
import torch

from hpc.spec import Train
from trainer.optim import build_optimizer, build_scheduler, clip_grad_norm, grad_norm, lr_factor


def test_warmup_then_cosine_to_min_ratio():
    train = Train(steps=12, warmup_steps=2, min_lr_ratio=0.1)
    factors = [lr_factor(s, train) for s in range(12)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(factors[2:], factors[3:]))
    assert factors[2 + 9 // 2] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))


def test_constant_schedule_and_scheduler_steps():
    train = Train(steps=5, warmup_steps=1, schedule="constant", lr=0.01)
    model = torch.nn.Linear(2, 2, bias=True)
    opt = build_optimizer(model, train)
    sched = build_scheduler(opt, train)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == [0.01, 0.01, 0.01, 0.01]
    assert [g["weight_decay"] for g in opt.param_groups] == [train.weight_decay, 0.0]


def test_grad_norm_matches_torch_and_clips():
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 3))
    model(torch.randn(4, 30)).square().sum().backward()
    params = list(model.parameters())
    expected = torch.nn.utils.get_total_norm([p.grad for p in params]).item()
    assert grad_norm(params).item() == pytest.approx(expected, rel=1e-6)
    before = float(clip_grad_norm(params, max_norm=expected / 2))
    assert before == pytest.approx(expected, rel=1e-6)
    assert grad_norm(params).item() == pytest.approx(expected / 2, rel=1e-5)
