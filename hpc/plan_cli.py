"""`hpcx plan` and `hpcx site detect` (registered by hpc.cli). No torch import."""

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
@set_option
@json_option
def plan_command(job: str, site_name: str | None, nodes: int | None, overrides: tuple[str, ...], as_json: bool) -> None:
    """Per-GPU memory and communication per step of every strategy for JOB on a site, and the choice.

    `parallel.strategy = "auto"` in the spec submits exactly the strategy recommended here.
    """
    from hpc.plan import format_plan, plan_job
    from hpc.resolve import cross_check
    from hpc.site import choose_site, load_site
    from hpc.spec import load_spec

    extra = (f"job.nodes={nodes}",) if nodes else ()
    spec = load_spec(job, tuple(overrides) + extra)
    site = load_site(choose_site(site_name, spec.job.site))
    errors = cross_check(spec, site)
    if errors:
        raise ConfigError([f"{spec.source}: {e}" for e in errors])
    plan = plan_job(spec, site)
    if as_json:
        echo_json(plan.to_dict())
    else:
        click.echo(format_plan(plan))


@click.command("detect")
@click.option("--name", default="detected", show_default=True, help="Name written into the draft.")
@click.option("--topo", type=click.Path(exists=True, dir_okay=False), help="Saved `nvidia-smi topo -m` output.")
@click.option("--query", type=click.Path(exists=True, dir_okay=False),
              help="Saved `nvidia-smi --query-gpu=name,memory.total --format=csv` output.")
@click.option("--scontrol", type=click.Path(exists=True, dir_okay=False), help="Saved `scontrol show node` output.")
def detect_command(name: str, topo: str | None, query: str | None, scontrol: str | None) -> None:
    """Draft a site profile (TOML on stdout) from this GPU node's tools, or from saved outputs.

    Runs nvidia-smi and scontrol for the files not given; says in comments what it could not tell.
    """
    from hpc.detect import draft_site, parse_query_gpu, parse_scontrol_nodes, parse_topo, render_toml

    problems: list[str] = []
    topo_text = _text(topo, ["nvidia-smi", "topo", "-m"], problems)
    query_text = _text(query, ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv"], problems)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    slurm_text = _text(scontrol, ["scontrol", "show", "node", node], problems)
    parsed_topo = _parse(parse_topo, topo_text, topo, problems)
    parsed_query = _parse(parse_query_gpu, query_text, query, problems)
    parsed_slurm = _parse(parse_scontrol_nodes, slurm_text, scontrol, problems)
    draft = draft_site(name, parsed_topo, parsed_query, parsed_slurm or None)
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


def _parse(parser: tp.Callable[[str], tp.Any], text: str | None, path: str | None, problems: list[str]) -> tp.Any:
    if text is None:
        return None
    try:
        return parser(text)
    except ValueError as exc:
        if path:  # a file the user pointed at is input: say so and stop
            raise ConfigError([f"{path}: {exc}"]) from None
        problems.append(str(exc))
        return None
