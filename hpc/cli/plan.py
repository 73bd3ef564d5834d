"""`hpcx plan` and `hpcx site detect` (registered by hpc.cli). No torch import, except `plan --count-params`."""

from __future__ import annotations

import typing as tp

import click

from hpc.cli import refuse_script_mode
from hpc.cli.clickutil import echo_json, json_option, set_option, site_option
from hpc.core.config import ConfigError
from hpc.core.workload import TaskWorkload


@click.command("plan")
@click.argument("job", type=click.Path(dir_okay=False))
@site_option
@click.option("--nodes", type=click.IntRange(min=1), default=None, help="Plan for this many nodes (job.nodes).")
@click.option("--count-params", is_flag=True,
              help="Build a user model on the meta device to count its parameters (imports torch).")
@set_option
@json_option
def plan_command(job: str, site_name: str | None, nodes: int | None, count_params: bool, overrides: tuple[str, ...],
                 as_json: bool) -> None:
    """Per-GPU memory and time per step of every strategy for JOB on a site, and the choice.

    `parallel.strategy = "auto"` in the spec submits exactly the strategy recommended here (with
    --count-params, only once the counted numbers are stated in the spec).
    """
    from hpc.core.models import model_facts  # lazy: startup
    from hpc.plan import format_plan, plan_job  # lazy: startup
    from hpc.core.resolve import cross_check  # lazy: startup
    from hpc.core.site import select_site  # lazy: startup
    from hpc.core.spec import load_spec, set_origins  # lazy: startup

    extra = (f"job.nodes={nodes}",) if nodes else ()
    spec = load_spec(job, tuple(overrides) + extra)
    refuse_script_mode(spec, "plan")
    site = select_site(site_name, spec)
    errors = cross_check(spec, site)
    if errors:
        raise ConfigError(set_origins([f"{spec.source}: {e}" for e in errors], spec.source, overrides))
    facts = _counted_facts(spec.model) if count_params else model_facts(spec.model)
    if isinstance(spec.workload, TaskWorkload):  # a task's model is known only by building it
        facts = _counted_task_facts(spec)
    plan = plan_job(spec, site, facts=facts)
    if as_json:
        echo_json(plan.to_dict())
    else:
        click.echo(format_plan(plan))


def _counted_facts(model: tp.Any) -> tp.Any:
    """A user model's facts from a meta-device build (torch, on request only), with a note saying
    what to state in the spec so `auto` and `submit` plan with the same numbers."""
    from hpc.core.models import counted_by_building, model_facts  # lazy: startup

    if not counted_by_building(model):
        return model_facts(model)  # a built-in family's count follows from its shape: nothing to build
    from hpc.core import imports  # lazy: startup

    imports.check()  # before the trainer is imported
    from trainer.count import count_model  # lazy: torch

    counted = count_model(model)
    click.echo(f"counted on the meta device: {counted.n_params} parameters in {counted.n_units} blocks "
               f"(largest {counted.unit_params}); state model.n_params = {counted.n_params}, model.n_layers = "
               f"{counted.n_units} and model.dim in the spec so `auto` uses them", err=True)
    return model_facts(model, counted)


def _counted_task_facts(spec: tp.Any) -> tp.Any:
    """A task's model's facts from a meta-device build (``trainer.count.count_task``; torch)."""
    from hpc.core import imports  # lazy: startup
    from hpc.core.models import model_facts  # lazy: startup

    imports.check()  # before the trainer is imported
    from trainer.count import count_task  # lazy: torch

    return model_facts(spec.model, count_task(spec))


@click.command("detect")
@click.option("--name", default="detected", show_default=True, help="Name written into the draft.")
@click.option("--topo", type=click.Path(exists=True, dir_okay=False), help="Saved `nvidia-smi topo -m` output.")
@click.option("--query", type=click.Path(exists=True, dir_okay=False),
              help="Saved `nvidia-smi --query-gpu=name,memory.total,mig.mode.current --format=csv` output "
              "(the MIG column may be left out).")
@click.option("--scontrol", type=click.Path(exists=True, dir_okay=False), help="Saved `scontrol show node` output.")
def detect_command(name: str, topo: str | None, query: str | None, scontrol: str | None) -> None:
    """Draft a site profile (TOML on stdout) from this GPU node's tools, or from saved outputs.

    Runs nvidia-smi and scontrol for the files not given; says in comments what it found, what it
    assumed and what it could not tell. A matrix cut short, asymmetric or with unknown cells is
    refused (exit 2). Without Slurm the draft is a `local` site for this machine. hpcx plans whole
    GPUs: MIG enabled (mig.mode.current) is said in the draft's comments, and MIG devices given in
    place of GPUs (a `nvidia-smi -L` listing, a matrix labelling them) are refused (exit 2).
    """
    from hpc import schedulers  # lazy: startup

    click.echo(schedulers.detect_site(name, {"topo": topo, "query": query, "scontrol": scontrol}), nl=False)


