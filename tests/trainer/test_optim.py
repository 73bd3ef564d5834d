"""Schedule numbers and the fp64 gradient norm."""

from __future__ import annotations

import math

import pytest
import torch

from hpc.core.spec import Train
from trainer.optim import build_optimizer, build_scheduler, clip_grad_norm, fused_supported, grad_norm, lr_factor


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


# ---------------------------------------------------------------- fused AdamW


def one_group_model(dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_adamw_is_fused_on_cpu_for_every_float_dtype(dtype):
    opt = build_optimizer(one_group_model(dtype), Train())
    assert all(g["fused"] for g in opt.param_groups)
    model = opt.param_groups[0]["params"]
    for p in model:
        p.grad = torch.ones_like(p)
    opt.step()  # the fused kernel takes them (torch checks only here)


@pytest.mark.parametrize("params,fused", [
    ([torch.nn.Parameter(torch.zeros(3, 3))], True),
    ([torch.nn.Parameter(torch.zeros(3, 3, device="meta"))], False),
    ([torch.nn.Parameter(torch.zeros(3, 3, dtype=torch.complex64))], False),
    ([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))], False),
    ([], False),
])
def test_fused_only_where_the_kernel_takes_every_parameter(params, fused):
    assert fused_supported(params) is fused


def test_a_model_without_a_fused_kernel_gets_the_multi_tensor_adamw():
    model = torch.nn.Linear(3, 3).to(torch.complex64)
    opt = build_optimizer(model, Train())
    assert not any(g["fused"] for g in opt.param_groups)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def test_fused_follows_the_same_update_as_the_multi_tensor_adamw():
    torch.manual_seed(0)
    a, b = one_group_model(), one_group_model()
    b.load_state_dict(a.state_dict())
    train = Train(lr=1e-2, weight_decay=0.1)
    fused = build_optimizer(a, train)
    plain = torch.optim.AdamW([{"params": [p for p in b.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                               {"params": [p for p in b.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                              lr=1e-2, betas=tuple(train.betas), foreach=True)
    for step in range(5):
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step))
        for model, opt in ((a, fused), (b, plain)):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)
    assert fused.state_dict()["state"].keys() == plain.state_dict()["state"].keys()


def test_fused_skips_the_step_a_grad_scaler_finds_inf_in():
    model = one_group_model()
    opt = build_optimizer(model, Train(lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.full((2, 6), float("inf"))).sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0 ** 3  # backed off
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 6)).sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_fused_adamw_checkpoint_state_loads_into_the_multi_tensor_one_and_back():
    model = one_group_model()
    fused = build_optimizer(model, Train())
    model(torch.ones(2, 6)).sum().backward()
    fused.step()
    plain = torch.optim.AdamW([{"params": g["params"]} for g in fused.param_groups], foreach=True)
    plain.load_state_dict(fused.state_dict())
    fused.load_state_dict(plain.state_dict())
    assert all(g["fused"] for g in fused.param_groups)
    assert float(fused.state[model[0].weight]["step"]) == 1.0


def test_fp16_under_fsdp_gets_the_multi_tensor_adamw():
    """ShardedGradScaler's found_inf has shape [1]; the fused step cannot take it (the fsdp2_fp16
    case of test_equivalence trains through it under FSDP2)."""
    model = one_group_model()
    assert build_optimizer(model, Train()).defaults["fused"]
    assert not build_optimizer(model, Train(), sharded_scaler=True).defaults["fused"]
