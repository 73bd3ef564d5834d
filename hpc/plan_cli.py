"""`hpcx plan` and `hpcx site detect` (registered by hpc.cli). No torch import, except `plan --count-params`."""

from __future__ import annotations

import os
import socket
import subprocess
import typing as tp
from pathlib import Path

import click

from hpc.clickutil import echo_json, json_option, set_option, site_option
from hpc.config import ConfigError


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
    from hpc.models import model_facts
    from hpc.plan import format_plan, plan_job
    from hpc.resolve import cross_check
    from hpc.site import select_site
    from hpc.spec import load_spec, set_origins

    extra = (f"job.nodes={nodes}",) if nodes else ()
    spec = load_spec(job, tuple(overrides) + extra)
    site = select_site(site_name, spec)
    errors = cross_check(spec, site)
    if errors:
        raise ConfigError(set_origins([f"{spec.source}: {e}" for e in errors], spec.source, overrides))
    facts = _counted_facts(spec.model) if count_params else model_facts(spec.model)
    plan = plan_job(spec, site, facts=facts)
    if as_json:
        echo_json(plan.to_dict())
    else:
        click.echo(format_plan(plan))


def _counted_facts(model: tp.Any) -> tp.Any:
    """A user model's facts from a meta-device build (torch, on request only), with a note saying
    what to state in the spec so `auto` and `submit` plan with the same numbers."""
    from hpc.models import model_facts

    if model.arch == "gpt":
        return model_facts(model)  # the built-in GPT's count follows from its shape: nothing to build
    from trainer.count import count_model

    counted = count_model(model)
    click.echo(f"counted on the meta device: {counted.n_params} parameters in {counted.n_units} blocks "
               f"(largest {counted.unit_params}); state model.n_params = {counted.n_params}, model.n_layers = "
               f"{counted.n_units} and model.dim in the spec so `auto` uses them", err=True)
    return model_facts(model, counted)


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
    refused (exit 2). Without Slurm the draft is a `local` site for this machine.
    """
    from hpc.detect import (QUERY_COMMAND, Host, draft_site, parse_query_gpu, parse_scontrol_nodes, parse_topo,
                            render_toml)

    problems: list[str] = []
    topo_text = _text(topo, ["nvidia-smi", "topo", "-m"], problems)
    query_text = _text(query, QUERY_COMMAND, problems)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    slurm_text = _text(scontrol, ["scontrol", "show", "node", node], problems)
    parsed_topo = _parse(parse_topo, topo_text, topo or "`nvidia-smi topo -m`")
    parsed_query = _parse(parse_query_gpu, query_text, query or "`nvidia-smi --query-gpu`")
    parsed_slurm = _parse(parse_scontrol_nodes, slurm_text, scontrol or "`scontrol show node`")
    host = None if topo or query else Host.here()  # this machine's CPUs and memory, when it is the GPU node
    try:
        draft = draft_site(name, parsed_topo, parsed_query, parsed_slurm or None, host)
    except ValueError as exc:
        raise ConfigError([f"{topo or 'nvidia-smi'}: {exc}"]) from None
    draft.unknown[:0] = problems
    click.echo(render_toml(draft), nl=False)


def _text(path: str | None, command: list[str], problems: list[str]) -> str | None:
    if path:
        try:
            return Path(path).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise ConfigError([f"{path}: cannot read: {exc}"]) from None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        problems.append(f"could not run `{' '.join(command)}`: {exc}")
        return None
    if done.returncode != 0:
        problems.append(f"`{' '.join(command)}` exited {done.returncode}: {done.stderr.strip()[:200]}")
        return None
    return done.stdout


def _parse(parser: tp.Callable[[str], tp.Any], text: str | None, source: str) -> tp.Any:
    """Parsed output, or None when there was none; output that does not parse is refused (a draft built
    on half of it would be confidently wrong)."""
    if text is None:
        return None
    try:
        return parser(text)
    except ValueError as exc:
        raise ConfigError([f"{source}: {exc}"]) from None
