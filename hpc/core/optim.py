"""The ``[optim]`` section, torch-free: which ``torch.optim`` optimizer trains, with which keyword
arguments, and the parameters of the step schedules; what the spec loader checks of them and what the
planner counts of the optimizer's state.

The login node never imports torch, so the optimizers' signatures are a table here (``SIGNATURES``:
each keyword argument and its default in torch 2.13), checked against torch's own by
tests/test_optim_spec.py: a torch that renames or adds an argument fails that test, not a job.
A key of ``optim.kwargs`` that the optimizer does not take, or a value of the wrong kind, is one line
at submit; torch checks the values' ranges when the first rank builds the optimizer (a ValueError
there is one line too, and the job is not requeued).

Not offered: ``LBFGS`` (its ``step`` needs a closure that re-runs the forward), ``SparseAdam`` (sparse
gradients only), ``Adafactor`` (its factored second moments are no whole number of copies of the
parameters) and ``Muon`` (2-D parameters only: it needs a second optimizer for the rest).
"""

from __future__ import annotations

import math
import typing as tp
from dataclasses import dataclass

from hpc.core.config import field

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import JobSpec

DEFAULT = "AdamW"
SCHEDULES = ("cosine", "constant", "linear", "step", "multistep", "onecycle")

# Keyword arguments (besides ``params`` and ``lr``, which hpcx gives) and torch 2.13's defaults.
SIGNATURES: dict[str, dict[str, tp.Any]] = {
    "ASGD": {"lambd": 0.0001, "alpha": 0.75, "t0": 1000000.0, "weight_decay": 0, "foreach": None, "maximize": False,
             "differentiable": False, "capturable": False},
    "Adadelta": {"rho": 0.9, "eps": 1e-06, "weight_decay": 0, "foreach": None, "capturable": False,
                 "maximize": False, "differentiable": False},
    "Adagrad": {"lr_decay": 0, "weight_decay": 0, "initial_accumulator_value": 0, "eps": 1e-10, "foreach": None,
                "maximize": False, "differentiable": False, "fused": None},
    "Adam": {"betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "amsgrad": False, "foreach": None,
             "maximize": False, "capturable": False, "differentiable": False, "fused": None,
             "decoupled_weight_decay": False},
    "AdamW": {"betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0.01, "amsgrad": False, "maximize": False,
              "foreach": None, "capturable": False, "differentiable": False, "fused": None},
    "Adamax": {"betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "foreach": None, "maximize": False,
               "differentiable": False, "capturable": False},
    "NAdam": {"betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "momentum_decay": 0.004,
              "decoupled_weight_decay": False, "foreach": None, "maximize": False, "capturable": False,
              "differentiable": False},
    "RAdam": {"betas": (0.9, 0.999), "eps": 1e-08, "weight_decay": 0, "decoupled_weight_decay": False,
              "foreach": None, "maximize": False, "capturable": False, "differentiable": False},
    "RMSprop": {"alpha": 0.99, "eps": 1e-08, "weight_decay": 0, "momentum": 0, "centered": False, "capturable": False,
                "foreach": None, "maximize": False, "differentiable": False},
    "Rprop": {"etas": (0.5, 1.2), "step_sizes": (1e-06, 50), "capturable": False, "foreach": None, "maximize": False,
              "differentiable": False},
    "SGD": {"momentum": 0, "dampening": 0, "weight_decay": 0, "nesterov": False, "maximize": False, "foreach": None,
            "differentiable": False, "fused": None},
}
NOT_OFFERED = {"LBFGS": "its step needs a closure that re-runs the forward",
               "SparseAdam": "it takes sparse gradients only",
               "Adafactor": "its factored state is no whole number of copies of the parameters",
               "Muon": "it takes 2-D parameters only"}
# ``train.weight_decay`` and ``train.betas`` are AdamW's (the default optimizer); ``lr`` is ``train.lr``
TRAIN_OWNED = {"lr": "train.lr", "params": None}
ADAMW_OWNED = {"weight_decay": "train.weight_decay", "betas": "train.betas"}


@dataclass
class Optim:
    """The spec's ``[optim]`` section (docs/tasks.md, "Optimizer, schedule, best checkpoint, early stopping")."""

    name: str = field(DEFAULT, doc="A `torch.optim` optimizer by its class name (any case): " + ", ".join(
        f"`{n}`" for n in SIGNATURES) + " (not " + ", ".join(f"`{n}`" for n in NOT_OFFERED) + "). The learning "
        "rate is `train.lr`, shaped by `train.schedule`; weight decay, whatever the optimizer, applies to matrices "
        "and embeddings only (not to norms and biases).")
    kwargs: dict[str, tp.Any] = field(doc="The optimizer's keyword arguments besides `params` and `lr` (e.g. "
                                      "`{ momentum = 0.9, nesterov = true, weight_decay = 1e-4 }` for SGD), checked "
                                      "against its signature at submit. AdamW's `weight_decay` and `betas` are "
                                      "`train.weight_decay` and `train.betas`.", factory=dict)
    step_size: int = field(0, doc="`train.schedule = \"step\"`: the learning rate is multiplied by `gamma` every "
                           "`step_size` optimizer steps (counted from step 0).", minimum=0)
    milestones: list[int] = field(doc="`train.schedule = \"multistep\"`: the optimizer steps (0-based, increasing) "
                                  "from which the learning rate is multiplied by `gamma` once more.", factory=list)
    gamma: float = field(0.1, doc="The factor of `step` and `multistep`.", minimum=0, maximum=1)
    div_factor: float = field(25.0, doc="`train.schedule = \"onecycle\"`: the cycle starts at `train.lr / "
                              "div_factor` (torch's OneCycleLR's default).", minimum=1)


def canonical(name: str) -> str | None:
    """The class name ``name`` means (case-insensitive: ``sgd`` is ``SGD``), or None."""
    return next((n for n in SIGNATURES if n.lower() == name.lower()), None)


def optim_problems(spec: JobSpec) -> list[str]:
    """What is wrong with ``[optim]`` and the schedule fields of ``[train]``; one line each."""
    o = spec.optim
    name = canonical(o.name)
    if name is None:
        why = NOT_OFFERED.get(next((n for n in NOT_OFFERED if n.lower() == o.name.lower()), ""))
        return [f"`optim.name` = {o.name!r}: " + (f"not offered ({why})" if why else "not a torch.optim optimizer")
                + f": expected one of {', '.join(SIGNATURES)}"]
    o.name = name
    return kwargs_problems(name, o.kwargs) + schedule_problems(spec)


def kwargs_problems(name: str, kwargs: tp.Mapping[str, tp.Any]) -> list[str]:
    """One line per key of ``optim.kwargs`` that ``name`` does not take or gets the wrong kind of value for."""
    signature, out = SIGNATURES[name], []
    for key, value in kwargs.items():
        owner = TRAIN_OWNED.get(key, ADAMW_OWNED.get(key) if name == DEFAULT else None)
        if key in TRAIN_OWNED or (name == DEFAULT and key in ADAMW_OWNED):
            out.append(f"`optim.kwargs.{key}`: " + (f"set `{owner}` instead" if owner else "hpcx passes the "
                                                    "model's parameters itself"))
        elif key not in signature:
            out.append(f"`optim.kwargs.{key}`: torch.optim.{name} takes no `{key}`: expected one of "
                       f"{', '.join(k for k in signature if not (name == DEFAULT and k in ADAMW_OWNED))}")
        elif (expected := wrong_kind(value, signature[key])) is not None:
            out.append(f"`optim.kwargs.{key}` = {value!r}: expected {expected} (torch.optim.{name}'s default is "
                       f"{signature[key]!r})")
    return out


def _number(x: tp.Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def wrong_kind(value: tp.Any, default: tp.Any) -> str | None:
    """What ``value`` should be, judged by the argument's default (None when it fits): a flag for a boolean
    or ``None`` default (torch's ``foreach``/``fused``), a finite number for a number, a list of as many
    numbers for a tuple."""
    if isinstance(default, bool) or default is None:
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, tuple):
        fits = isinstance(value, list) and len(value) == len(default) and all(_number(v) for v in value)
        return None if fits else f"a list of {len(default)} numbers"
    return None if _number(value) else "a finite number"


def schedule_problems(spec: JobSpec) -> list[str]:
    """The schedule's own parameters: given where it needs them, and not given for another schedule."""
    o, schedule, out = spec.optim, spec.train.schedule, []
    if schedule == "step" and o.step_size < 1:
        out.append("`train.schedule` = 'step' needs `optim.step_size` (optimizer steps between decays, at least 1)")
    if schedule == "multistep" and not o.milestones:
        out.append("`train.schedule` = 'multistep' needs `optim.milestones` (the optimizer steps where the learning "
                   "rate drops)")
    if o.milestones and (any(m < 1 for m in o.milestones) or o.milestones != sorted(set(o.milestones))):
        out.append(f"`optim.milestones` = {o.milestones!r}: expected increasing optimizer steps, each at least 1")
    unused = {"step_size": (o.step_size != 0, ("step",)), "milestones": (bool(o.milestones), ("multistep",)),
              "gamma": (o.gamma != 0.1, ("step", "multistep")), "div_factor": (o.div_factor != 25.0, ("onecycle",))}
    out += [f"`optim.{key}` is set, but `train.schedule` = {schedule!r} does not use it: it applies to "
            f"{' and '.join(repr(s) for s in used)}" for key, (given, used) in unused.items()
            if given and schedule not in used]
    return out


def adamw_fields_given(doc: dict[str, tp.Any]) -> list[str]:
    """``train.weight_decay`` or ``train.betas`` given with another optimizer than AdamW, in a spec as written
    (a run's resolved.json records their defaults): they would be silently unused."""
    optim, train = doc.get("optim"), doc.get("train")
    name = optim.get("name") if isinstance(optim, dict) else None
    if not isinstance(name, str) or not isinstance(train, dict) or canonical(name) in (None, DEFAULT):
        return []
    return [f"`train.{key}` is AdamW's, but `optim.name` = {name!r}: set `optim.kwargs.{key}` instead"
            for key in ADAMW_OWNED if key in train]


def state_copies(name: str, kwargs: tp.Mapping[str, tp.Any]) -> int:
    """Copies of the trained parameters the optimizer keeps as state (in the parameters' dtype): what the
    planner counts. SGD: its momentum buffer, when momentum is on; the Adam family: two moments (three with
    ``amsgrad``); RMSprop: its square average, plus a momentum buffer and a gradient average when on."""
    name = canonical(name) or DEFAULT
    on = {k: kwargs.get(k, SIGNATURES[name].get(k)) for k in ("momentum", "amsgrad", "centered")}
    if name == "SGD":
        return 1 if on["momentum"] else 0
    if name == "RMSprop":
        return 1 + bool(on["momentum"]) + bool(on["centered"])
    if name in ("Adam", "AdamW"):
        return 3 if on["amsgrad"] else 2
    return {"Adagrad": 1, "ASGD": 1}.get(name, 2)  # Adadelta, Adamax, NAdam, RAdam, Rprop: two


def state_bytes(spec: JobSpec) -> int:
    """Bytes of optimizer state per trained parameter (fp32 state: 4 per copy)."""
    return 4 * state_copies(spec.optim.name, spec.optim.kwargs)
