"""The planner: per-rank memory and per-step time of every strategy, and a choice.

``plan_job(spec, site, nodes)`` evaluates each candidate (ddp, fsdp with each sharding,
hsdp with node-sized and multi-node shard groups, each FSDP layout with CPU offload where the
spec allows it) and recommends the simplest of those that fit and whose estimated step is within
``TIE`` of the fastest; offload rows only when nothing fits without offload. Communication is timed
with NCCL's own cost model (``hpc.plan.collectives``); when nothing fits, ``hpc.plan.advice`` searches
the cheapest change that does. ``choose`` is what ``resolve`` calls: an explicit strategy in the spec is
respected, ``auto`` takes the plan's choice. Pure Python: runs on login nodes without torch.
"""

from __future__ import annotations

import importlib
import typing as tp
import dataclasses
from dataclasses import dataclass, replace

from hpc.core.config import ConfigError
from hpc.core.dims import ParallelDims, parallel_dims, tasks_per_node

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.models import ModelFacts
    from hpc.core.resolve import Launch
    from hpc.core.site import SiteProfile
    from hpc.core.spec import JobSpec
    from hpc.plan.rows import Plan, Row

# The planner's own modules load on first use (PEP 562): ``choose`` for a strategy the spec sets, what
# ``hpcx render`` and ``submit`` resolve, imports none of them. Name -> the module that defines it.
LAZY = {**dict.fromkeys(("MFU_DEFAULT", "TIE", "Candidate", "Plan", "Row", "Setup", "candidates", "compute_seconds",
                         "evaluate", "mfu_of", "pick", "setup_of"), "hpc.plan.rows"),
        "format_plan": "hpc.plan.table"}


def __getattr__(name: str) -> tp.Any:
    """A name of ``LAZY``, from its module (imported now, kept here after)."""
    if name in LAZY:
        value = globals()[name] = getattr(importlib.import_module(LAZY[name]), name)
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DRYRUN_NOTE = ("check: `hpcx dryrun JOB --site SITE` builds the real sharded model, mesh and optimizer at this "
               "world size on one CPU (it imports torch) and compares its bytes per rank with these")

__all__ = ["MFU_DEFAULT", "TIE", "Candidate", "Choice", "Plan", "Row", "Setup", "candidates", "choose",
           "compute_seconds", "evaluate", "format_plan", "launch_row", "mfu_of", "pick", "plan_job", "setup_of"]


def plan_job(spec: JobSpec, site: SiteProfile, nodes: int | None = None, facts: ModelFacts | None = None) -> Plan:
    """Evaluate every strategy for ``spec`` on ``site`` (``nodes`` overrides job.nodes; ``facts``
    overrides what the spec says about the model, e.g. counted by ``hpcx plan --count-params``)."""
    from hpc.core.models import model_facts  # lazy: startup
    from hpc.plan.advice import advise  # lazy: startup
    from hpc.plan.explain import plan_notes, recommend, unknown_model  # lazy: startup
    from hpc.plan.memory import peaks_note  # lazy: startup
    from hpc.plan.degrees import cross_advice, evaluate_degrees, family_rows, planned_degrees, tried_lines  # lazy: startup
    from hpc.plan.rows import Plan, compute_seconds, mfu_of, nvlink_domain, setup_of  # lazy: startup
    from hpc.core.lora import with_lora  # lazy: startup

    facts = with_lora(facts or model_facts(spec.model), spec)
    setup = setup_of(spec, site, nodes)
    gpu = site.node.gpus > 0
    allowed = spec.parallel.cpu_offload  # allowed, not required: candidates with and without offload
    searched = facts.n_params is not None and spec.parallel.strategy == "auto" and setup.tp == 1
    degrees = planned_degrees(facts, setup, site, searched)
    found = evaluate_degrees(facts, replace(setup, batch_checked=len(degrees) > 1), site, allowed, degrees)
    if found.best is not None and facts.n_params is not None:
        setup = replace(setup, tp=found.best)
    rows = found.rows.get(setup.tp) or next(iter(found.rows.values()))
    choice = found.picks.get(setup.tp) if facts.n_params is not None and found.best is not None else None
    mfu, mfu_source = mfu_of(site)
    plan = Plan(job=spec.job.name, site=site.name, model=facts.label, n_params=facts.n_params,
                nodes=setup.nodes, tasks_per_node=setup.tasks_per_node, micro_batch=setup.micro_batch,
                grad_accum=setup.grad_accum, mixed_precision=setup.mixed_precision,
                checkpointing=setup.checkpointing, compute_s=compute_seconds(facts, setup, site, mfu),
                mfu=mfu, rows=rows, choice=choice, offload_allowed=allowed, mfu_source=mfu_source,
                tp=setup.tp)
    if choice is not None:
        family = family_rows(facts, setup, site, allowed, choice, found)
        plan.tp_rows, plan.tp_cross_domain = family, setup.tp_cross_domain
    plan.nvlink_domain = nvlink_domain(site)
    plan.notes = plan_notes(site, setup, facts, spec.parallel.strategy)
    if facts.n_params is not None:
        plan.notes.append(peaks_note(facts, setup.async_save, gpu))
    plan.notes.append(DRYRUN_NOTE)
    if facts.n_params is None:
        plan.recommendation = unknown_model(plan, setup)
    elif choice is None:
        plan.advice = advise(facts, setup, site, rows, allowed, shorter_model(spec, facts))
        plan.advice[1:1] = ["Layouts tried, one line per family (none can run: it does not fit, or its global batch "
                            "does not divide):"] + ["  " + x for x in tried_lines(found, setup.tasks_per_node)]
        wide = cross_advice(facts, setup, site, allowed) if searched else ""
        plan.advice += [wide] if wide else []
    else:
        plan.recommendation = recommend(plan, site, facts, setup)
        if facts.tp_split and choice.dims.fsdp_enabled:  # a family with a tensor-parallel plan, in a sharded layout
            plan.recommendation[1:1] = tp_words(choice, found, plan.tp_rows, site, setup.tp_cross_domain)
    return plan


def tp_words(choice: Row, found: tp.Any, family: list[Row], site: SiteProfile, cross: bool) -> list[str]:
    """Why this tensor-parallel degree (against the next best) and what crossing NVLink islands costs."""
    from hpc.plan.degrees import cross_line, why_line  # lazy: startup

    lines = [why_line(choice, found), cross_line(choice, family, site, cross)]
    return [x for x in lines if x]


def shorter_model(spec: JobSpec, facts: ModelFacts) -> ModelFacts | None:
    """The spec's model at half its sequence length (a lever on the floor), or None (a user model, or a
    sequence too short to halve)."""
    from hpc.core.models import model_facts  # lazy: startup

    if not facts.builtin or facts.seq_len < 256:
        return None
    try:
        return model_facts(dataclasses.replace(spec.model, seq_len=facts.seq_len // 2))
    except (ValueError, TypeError):
        return None


def launch_row(spec: JobSpec, site: SiteProfile, launch: Launch) -> Row:
    """The planner's row of the layout a resolved run uses, whether or not the plan lists it: at world
    size 1 the plan lists only ``none``, whose gradients and autocast copies an FSDP run does not hold."""
    from hpc.core.models import model_facts  # lazy: startup
    from hpc.plan.rows import evaluate, setup_of  # lazy: startup

    setup = dataclasses.replace(setup_of(spec, site, launch.nodes), tasks_per_node=launch.tasks_per_node,
                                tp=launch.dims.tp)
    offload = bool(launch.cpu_offload) and launch.dims.fsdp_enabled
    from hpc.core.lora import with_lora  # lazy: startup

    return evaluate(with_lora(model_facts(spec.model), spec), (launch.dims, offload), setup, site)


@dataclass(frozen=True)
class Choice:
    """What a run uses: the layout, whether FSDP offloads to the host, and why."""

    dims: ParallelDims
    cpu_offload: bool
    reasons: list[str]


def choose(spec: JobSpec, site: SiteProfile, nodes: int) -> Choice:
    """The spec's explicit strategy (with its cpu_offload), or the plan's choice for ``auto``."""
    p = spec.parallel
    tpn = tasks_per_node(p.strategy, spec.job.tasks_per_node, site.default_tasks_per_node())
    if p.strategy != "auto":
        dims = parallel_dims(p.strategy, p.sharding, nodes * tpn, tpn, p.shard_size, p.tp)
        return Choice(dims, p.cpu_offload and dims.fsdp_enabled, [f"strategy {p.strategy!r} set in the spec"])
    plan = plan_job(spec, site, nodes)
    if plan.n_params is None:
        dims = parallel_dims("none" if plan.world == 1 else "fsdp", "full_shard", plan.world)
        return Choice(dims, p.cpu_offload and dims.fsdp_enabled, plan.recommendation)
    if plan.choice is None:
        raise ConfigError([f"{spec.source}: `parallel.strategy` = 'auto' but no strategy fits {plan.model} on "
                           f"site {site.name!r} ({plan.nodes} nodes × {plan.tasks_per_node} ranks)"] + plan.advice)
    return Choice(plan.choice.dims, plan.choice.cfg.offload, plan.recommendation)
