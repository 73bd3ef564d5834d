"""``[optim]``: the torch-free table of optimizer signatures against torch's own, the state the planner
counts against the state a real optimizer keeps after a step, the schedules against torch's schedulers,
and what the trainer builds (``trainer.optim``). The refusals at submit are the corpus class
tests/corpus/optim/ (tests/test_spec.py)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

from hpc.core.errors import ConfigError
from hpc.core.optim import NOT_OFFERED, SIGNATURES, Optim, state_copies
from hpc.core.spec import Train, spec_from_dict
from trainer.optim import build_optimizer, build_scheduler, lr_factor


def torch_optimizers() -> set[str]:
    return {n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
            and issubclass(getattr(torch.optim, n), torch.optim.Optimizer) and n != "Optimizer"}


def test_every_torch_optimizer_is_offered_or_said_why_not():
    assert torch_optimizers() == set(SIGNATURES) | set(NOT_OFFERED)
    assert not set(SIGNATURES) & set(NOT_OFFERED)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_the_table_is_torchs_signature(name):
    params = inspect.signature(getattr(torch.optim, name).__init__).parameters
    real = {k: p.default for k, p in params.items() if k not in ("self", "params", "lr")}
    assert SIGNATURES[name] == real
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params.values())


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


CASES = [("SGD", {}), ("SGD", {"momentum": 0.9}), ("SGD", {"momentum": 0.9, "nesterov": True}), ("AdamW", {}),
         ("AdamW", {"amsgrad": True}), ("Adam", {}), ("Adam", {"amsgrad": True}), ("Adamax", {}), ("NAdam", {}),
         ("RAdam", {}), ("Adagrad", {}), ("Adadelta", {}), ("ASGD", {}), ("Rprop", {}), ("RMSprop", {}),
         ("RMSprop", {"momentum": 0.5}), ("RMSprop", {"momentum": 0.5, "centered": True})]


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{'-'.join(k) or 'plain'}" for n, k in CASES])
def test_the_planner_counts_the_state_copies_a_real_optimizer_keeps(name, kwargs):
    m = model()
    opt = build_optimizer(m, Train(lr=0.01), optim=Optim(name=name, kwargs=kwargs))
    assert type(opt).__name__ == name
    for _ in range(2):
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
    for p in m.parameters():
        copies = sum(1 for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.shape == p.shape)
        assert copies == state_copies(name, kwargs), (name, kwargs, sorted(opt.state[p]))


def plan_row(doc: dict) -> tuple[float, float]:
    """(params GB, optimizer GB) of the plan's row for ``doc`` (the tiny GPT on one local rank)."""
    from hpc.core.site import load_site
    from hpc.plan import launch_row
    from hpc.plan.resolve import resolve

    spec, site = spec_from_dict({"job": {"tasks_per_node": 1}, **doc}), load_site("local")
    memory = launch_row(spec, site, resolve(spec, site)).memory
    assert memory is not None
    return memory.params, memory.optimizer


def test_the_plan_counts_sgd_with_momentum_once_without_none_and_adam_twice():
    params, adamw = plan_row({})
    _, sgd = plan_row({"optim": {"name": "SGD"}})
    _, momentum = plan_row({"optim": {"name": "SGD", "kwargs": {"momentum": 0.9}}})
    _, amsgrad = plan_row({"optim": {"name": "Adam", "kwargs": {"amsgrad": True}}})
    assert (sgd, momentum, adamw, amsgrad) == pytest.approx((0.0, params, 2 * params, 3 * params), rel=1e-12)


def test_adamw_is_built_as_before_and_other_optimizers_decay_matrices_only():
    m = model()
    default = build_optimizer(m, Train(lr=0.01, weight_decay=0.05, betas=[0.8, 0.9]))
    assert type(default) is torch.optim.AdamW and default.defaults["betas"] == (0.8, 0.9)
    assert [g["weight_decay"] for g in default.param_groups] == [0.05, 0.0] and default.defaults["fused"]
    sgd = build_optimizer(m, Train(lr=0.01), optim=Optim("SGD", {"momentum": 0.9, "weight_decay": 1e-4}))
    assert [g["weight_decay"] for g in sgd.param_groups] == [1e-4, 0.0]
    assert [len(g["params"]) for g in sgd.param_groups] == [2, 4]  # two matrices; biases and the norm
    assert sgd.defaults["momentum"] == 0.9 and sgd.defaults["lr"] == 0.01
    rprop = build_optimizer(m, Train(lr=0.01), optim=Optim("Rprop", {"etas": [0.4, 1.1]}))
    assert rprop.defaults["etas"] == (0.4, 1.1) and len(rprop.param_groups) == 1


@pytest.mark.parametrize("kwargs,said", [({"momentum": -1.0}, "Invalid momentum value"),
                                         ({"nesterov": True}, "Nesterov momentum requires a momentum")])
def test_a_value_torch_refuses_is_one_config_error(kwargs, said):
    with pytest.raises(ConfigError) as info:
        build_optimizer(model(), Train(), optim=Optim("SGD", kwargs))
    assert len(info.value.messages) == 1 and "torch.optim.SGD refused" in info.value.messages[0]
    assert said in info.value.messages[0]


STEPS = 40


def torch_factors(make, steps: int = STEPS) -> list[float]:
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def ours(schedule: str, warmup: int = 0, min_ratio: float = 0.1, **optim: object) -> list[float]:
    train = Train(steps=STEPS, schedule=schedule, warmup_steps=warmup, min_lr_ratio=min_ratio, lr=1.0)
    return [lr_factor(s, train, Optim(**optim)) for s in range(STEPS)]  # type: ignore[arg-type]


S = torch.optim.lr_scheduler


@pytest.mark.parametrize("schedule,optim,make", [
    ("constant", {}, lambda o: S.LambdaLR(o, lambda s: 1.0)),
    ("cosine", {}, lambda o: S.CosineAnnealingLR(o, T_max=STEPS - 1, eta_min=0.1)),
    ("linear", {}, lambda o: S.LinearLR(o, start_factor=1.0, end_factor=0.1, total_iters=STEPS - 1)),
    ("step", {"step_size": 7, "gamma": 0.5}, lambda o: S.StepLR(o, step_size=7, gamma=0.5)),
    ("multistep", {"milestones": [5, 17, 30], "gamma": 0.3}, lambda o: S.MultiStepLR(o, [5, 17, 30], gamma=0.3)),
    ("onecycle", {"div_factor": 20.0}, lambda o: S.OneCycleLR(o, max_lr=1.0, total_steps=STEPS, pct_start=0.3,
                                                               div_factor=20.0, final_div_factor=0.5,
                                                               cycle_momentum=False)),
])
def test_each_schedule_without_warmup_is_torchs_scheduler(schedule, optim, make):
    assert ours(schedule, **optim) == pytest.approx(torch_factors(make), rel=1e-6, abs=1e-9)


def test_onecycle_rises_over_the_warmup_steps_and_ends_at_the_floor():
    rising = ours("onecycle", warmup=10, min_ratio=0.01)
    expected = torch_factors(lambda o: S.OneCycleLR(o, max_lr=1.0, total_steps=STEPS, pct_start=10 / STEPS,
                                                    final_div_factor=4.0, cycle_momentum=False))
    assert rising == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert rising[9] == 1.0 and rising[-1] == pytest.approx(0.01)


@pytest.mark.parametrize("schedule,optim,after", [
    ("constant", {}, {6: 1.0, 39: 1.0}), ("cosine", {}, {39: 0.1}), ("linear", {}, {22: 0.55, 39: 0.1}),
    ("step", {"step_size": 7}, {6: 1.0, 7: 0.1, 14: 0.01}), ("multistep", {"milestones": [12]}, {11: 1.0, 12: 0.1}),
])
def test_every_schedule_warms_up_linearly_then_follows_its_shape(schedule, optim, after):
    warm = ours(schedule, warmup=5, **optim)
    assert warm[:6] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert {step: warm[step] for step in after} == pytest.approx(after)


def test_the_default_cosine_is_the_old_formula_bit_for_bit():
    train = Train(steps=50, warmup_steps=4, min_lr_ratio=0.1)
    for step in range(4, 50):
        progress = min(1.0, (step - 4) / max(1, 50 - 4 - 1))
        old = 0.1 + 0.9 * (0.5 * (1.0 + math.cos(math.pi * progress)))
        assert lr_factor(step, train) == old


def test_a_scheduler_checkpoints_and_resumes_its_factor():
    m = model()
    train, optim = Train(lr=1.0, steps=20, schedule="multistep", warmup_steps=2), Optim(milestones=[4, 8])
    opt = build_optimizer(m, train, optim=Optim("SGD", {"momentum": 0.9}))
    sched = build_scheduler(opt, train, optim)
    for _ in range(6):
        opt.step()
        sched.step()
    again = build_scheduler(build_optimizer(m, train, optim=Optim("SGD")), train, optim)
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == sched.get_last_lr() == [pytest.approx(0.1)] * 2  # both param groups


@pytest.mark.parametrize("optim", [["optim.name='SGD'"], ["optim.name='SGD'", "optim.kwargs.momentum=0.9"],
                                   ["optim.name='Adam'", "optim.kwargs.amsgrad=true"],
                                   ["optim.name='RMSprop'", "optim.kwargs.centered=true", "optim.kwargs.momentum=0.5"]])
def test_the_dryrun_of_a_sharded_13b_measures_the_optimizer_state_the_plan_counts(optim):
    from tests.test_dryrun import BIG, _run, _sets

    result = _run(BIG, _sets("13b", 8, "fsdp") + optim)
    assert result.problems == [], "\n".join(result.problems)
    assert result.measured["optimizer"] == pytest.approx(result.planned["optimizer"], rel=0.01, abs=1e6)
    assert (result.planned["optimizer"] == 0) == (optim == ["optim.name='SGD'"])  # plain SGD keeps no state


@pytest.mark.parametrize("doc,said", [
    ({"train": {"steps": 100, "schedule": "multistep"}, "optim": {"milestones": [50, 100, 150]}},
     "`optim.milestones` [100, 150] are not before `train.steps` = 100"),
    ({"train": {"steps": 100, "schedule": "step"}, "optim": {"step_size": 100}},
     "`optim.step_size` = 100 is not shorter than `train.steps` = 100"),
    ({"train": {"steps": 100, "schedule": "multistep"}, "optim": {"milestones": [50, 99]}}, None),
])
def test_a_decay_that_never_comes_is_a_warning(doc, said):
    from hpc.core.spec import spec_warnings

    found = [w for w in spec_warnings(spec_from_dict(doc)) if "optim." in w]
    assert found == ([f"<spec>: {said}: the learning rate never drops" + (" there" if "milestones" in said else "")]
                     if said else [])


def test_a_bad_optimizer_key_at_submit_is_one_line_exit_2_and_no_run_folder(tmp_path):
    from tests.conftest import REPO, hpcx

    root = tmp_path / "runs"
    out = hpcx("submit", str(REPO / "jobs" / "tiny-ddp.toml"), "--set", f"job.run_root={str(root)!r}",
               "--set", "optim.name='SGD'", "--set", "optim.kwargs.momentun=0.9")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "error: --set: `optim.kwargs.momentun`: torch.optim.SGD takes no `momentun`: expected one of momentum, "
        "dampening, weight_decay, nesterov, maximize, foreach, differentiable, fused"]
    assert not root.exists() or not any(root.iterdir())
