"""The `hpcx` command line. Login-node commands here never import torch.

Shell completion (bash; zsh and fish likewise with zsh_source / fish_source)::

    eval "$(_HPCX_COMPLETE=bash_source hpcx)"
"""

from __future__ import annotations

import json
import sys
import time
import typing as tp
from pathlib import Path

import click

from hpc import __version__
from hpc.cli.clickutil import ErrorsGroup, echo_json, json_option, set_option, site_option
from hpc.core.config import ConfigError
from hpc.core.errors import CheckpointError, UserError
from hpc.core.validate import shown, unset_passthrough
from hpc.core.workload import ScriptWorkload
from hpc.login.status import format_status  # noqa: F401 - `hpcx status`'s line, also imported from here
from hpc.login.status import eval_text, run_roots as roots

class LazyGroup(ErrorsGroup):
    """A group whose commands that live in their own modules (``lazy``: name -> (module, attribute)) are
    imported only when named or listed: `hpcx status` does not import the planner or the checkpoint tools."""

    def __init__(self, *args: tp.Any, lazy: dict[str, tuple[str, str]] | None = None, **kwargs: tp.Any):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        """The command ``name``, importing its module the first time it is asked for."""
        if name in self.lazy and name not in self.commands:
            import importlib  # lazy: startup

            module, attribute = self.lazy[name]
            self.add_command(getattr(importlib.import_module(module), attribute), name)
        return super().get_command(ctx, name)


# Commands in their own modules (each torch-free at import).
LAZY = {"plan": ("hpc.cli.plan", "plan_command"), "ckpt": ("hpc.cli.ckpt", "ckpt_group"),
        "scale": ("hpc.cli.scale", "scale_group"), "data": ("hpc.cli.data", "data_group"),
        "plot": ("hpc.cli.plot", "plot_command"), "container": ("hpc.cli.container", "container_group")}


@click.group(cls=LazyGroup, lazy=LAZY, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpcx")
def cli() -> None:
    """hpcx: train PyTorch models on many GPUs and nodes through Slurm.

    A job spec (TOML) plus a site profile becomes a submitit submission; the
    trainer inside the job runs DDP/FSDP/HSDP with sharded checkpoints and
    survives preemption. Shell completion: eval "$(_HPCX_COMPLETE=bash_source hpcx)".
    """


def refuse_script_mode(spec: tp.Any, command: str) -> None:
    """``hpcx plan``/``dryrun`` of a script-mode spec: there is no model of hpcx's to count or build."""
    if isinstance(spec.workload, ScriptWorkload):
        raise UserError([f"{spec.source}: `job.command` runs your own script, so `hpcx {command}` has no model to "
                         "count or build: expected a spec of hpcx's trainer (a built-in model, a user model or a "
                         "task; docs/tasks.md)"])


def load_job(path: str, site_name: str | None, overrides: tp.Sequence[str]) -> tuple:
    """(spec, site, launch) with every problem reported as ConfigError."""
    from hpc.plan.resolve import resolve  # lazy: startup
    from hpc.core.site import select_site  # lazy: startup
    from hpc.core.spec import load_spec, set_origins  # lazy: startup

    spec = load_spec(path, overrides)
    site = select_site(site_name, spec)
    try:
        return spec, site, resolve(spec, site)
    except ConfigError as exc:
        raise ConfigError(set_origins(exc.messages, spec.source, overrides)) from None


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@site_option
@set_option
@click.option("--run-dir", default=None, help="Run folder shown in the script (default: a new one under the run root).")
@click.option("--strict", is_flag=True, help="Refuse (exit 2) when the plan estimates that the spec's layout does "
              "not fit in memory.")
def render(job: str, site_name: str | None, overrides: tuple[str, ...], run_dir: str | None, strict: bool) -> None:
    """Print exactly what `submit` would send (the sbatch script, or the local parameters).

    A summary of the launch goes to stderr, so `hpcx render job.toml > job.sh` keeps the script clean.
    """
    from hpc.login.render import render as render_text, render_summary  # lazy: startup

    from hpc.core.runs import run_dir_name  # lazy: startup
    from hpc.login.submit import run_root  # lazy: startup

    from hpc.core.runroot import check_run_dir_option  # lazy: startup

    spec, site, launch = load_job(job, site_name, overrides)
    check_memory(spec, site, launch, strict)
    check_init_from(spec)  # what submit refuses, render refuses too
    check_run_dir_option(run_dir)
    run_dir = run_dir or str(run_root(spec, site) / run_dir_name(spec.job.name, "YYYYmmdd-HHMMSS", "XXXXXX"))
    warn_passthrough(spec)
    click.echo(render_summary(spec, site, launch), err=True, nl=False)
    click.echo(render_text(spec, site, launch, run_dir, sys.executable), nl=False)


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@site_option
@set_option
@click.option("--wait", is_flag=True, help="Block, show progress, and print the result when the job ends.")
@click.option("--strict", is_flag=True, help="Refuse (exit 2) when the plan estimates that the spec's layout does "
              "not fit in memory.")
@json_option
def submit(job: str, site_name: str | None, overrides: tuple[str, ...], wait: bool, strict: bool,
           as_json: bool) -> None:
    """Create a run folder and submit JOB (a TOML spec); returns at once unless --wait."""
    from hpc.core import imports  # lazy: startup
    from hpc.login import submit as sub  # lazy: startup

    imports.check()  # the job's tasks import hpcx's `hpc` and `trainer`: refuse foreign ones here, in one line

    from hpc.login.render import user_code_notice  # lazy: startup

    spec, site, launch = load_job(job, site_name, overrides)
    check_memory(spec, site, launch, strict)
    check_init_from(spec)
    warn_passthrough(spec)
    if user_code_notice(spec):
        click.echo(f"note: {user_code_notice(spec)}", err=True)
    done = sub.submit(spec, site, launch, Path(job), overrides)
    if done.warning:
        click.echo(done.warning, err=True)
    if as_json and not wait:
        echo_json({"job_id": done.job_id, "run_dir": str(done.run_dir), "scheduler": done.scheduler})
        return
    if not as_json:
        from hpc.login.render import layout_words  # lazy: startup

        click.echo(f"submitted job {done.job_id} ({done.scheduler}, site {site.name}): "
                   f"{launch.nodes}×{launch.tasks_per_node} ranks, {layout_words(spec, launch)}")
        click.echo(f"run folder: {done.run_dir}")
        click.echo(f"follow:     hpcx logs {done.run_dir} -f")
    if wait:
        final = follow(done.run_dir, quiet=as_json)
        if as_json:
            echo_json(final)
        sys.exit(0 if final["state"] in ("COMPLETED", "FINISHED") else 1)


@cli.command()
@click.argument("ref", metavar="RUN")
@json_option
def resume(ref: str, as_json: bool) -> None:
    """Submit a cancelled, failed or timed-out RUN again, into the same folder: it resumes from its newest
    committed checkpoint (a new start in its ledger). Returns once the scheduler has the job."""
    from hpc.core import runs  # lazy: startup
    from hpc.login import submit as sub  # lazy: startup

    done = sub.resume(runs.find_run(ref, run_roots()))
    if as_json:
        echo_json({"job_id": done.job_id, "run_dir": str(done.run_dir), "scheduler": done.scheduler})
        return
    click.echo(f"resubmitted {done.run_dir.name} as job {done.job_id} ({done.scheduler})")
    click.echo(f"follow:     hpcx logs {done.run_dir} -f")


def check_init_from(spec: tp.Any) -> None:
    """``checkpoint.init_from`` against the model: a PEFT folder's config first (torch-free), then headers
    (importing torch only when it is set)."""
    if spec.checkpoint.init_from:
        from hpc.core.peft_config import config_problems  # lazy: startup

        problems = config_problems(spec)  # a PEFT folder's config: no torch needed to refuse it
        if problems:
            raise CheckpointError(problems)
        from hpc.ckpt.init_source import init_from_problems  # lazy: torch

        problems = init_from_problems(spec)
        if problems:
            raise CheckpointError(problems)


def check_memory(spec: tp.Any, site: tp.Any, launch: tp.Any, strict: bool) -> None:
    """A strategy set in the spec that the plan estimates runs out of memory: a warning line with the figure
    on stderr (``hpc.plan.warn``); under ``--strict`` a refusal (exit 2)."""
    from hpc.plan.warn import memory_warning  # lazy: startup

    if not spec.workload.uses_trainer:  # script mode: the script's memory is its own
        return
    line = memory_warning(spec, site, launch)
    if line is None:
        return
    if strict:
        raise ConfigError([f"{spec.source}: {line.removeprefix('warning: ').replace('; --strict refuses', '')} "
                           "(refused under --strict)"])
    click.echo(line, err=True)


def warn_passthrough(spec: tp.Any) -> None:
    """A passthrough name the submitting shell does not set reaches the job unset, and settings that
    load but are unlikely to be meant (``hpc.core.spec.spec_warnings``): say so now."""
    from hpc.core.spec import spec_warnings  # lazy: startup

    for line in spec_warnings(spec):
        click.echo(f"warning: {shown(line, 4000)}", err=True)

    for name in unset_passthrough(spec.env.passthrough):
        click.echo(f"warning: `env.passthrough` names {name}, but it is not set in this shell: "
                   "the job will not see it", err=True)


def follow(run_dir: Path, quiet: bool = False) -> dict:
    """Wait for the job, printing state changes and steps; then print the result."""
    from hpc.login import submit as sub  # lazy: startup

    last: dict[str, tp.Any] = {}

    def show(info: dict) -> None:
        if quiet:
            return
        if info["state"] != last.get("state") or info["step"] != last.get("step"):
            step = f" step {info['step']} loss {info['loss']:.4f}" if info["step"] is not None else ""
            click.echo(f"[{time.strftime('%H:%M:%S')}] {info['state']}{step}", err=True)
        last.update(info)

    final = sub.wait(run_dir, show)
    final["result"] = describe_result(sub.result(run_dir), final.get("last_stop"))
    if not quiet:
        click.echo(f"result: {format_result(final['result'])}")
    return final


def describe_result(outcome: tuple | None, last_stop: dict | None = None) -> tp.Any:
    """Rank 0's summary dict, or a line saying why there is none (with the ledger's last stop: a time
    limit, a preemption or a failure, in words)."""
    if outcome is None:
        why = f": {last_stop['words']}" if last_stop and last_stop.get("words") else ""
        return f"no result (the job did not finish its work{why})"
    kind, value = outcome
    if kind == "success":
        reason = last_stop.get("reason") if isinstance(value, dict) and last_stop is not None else None
        if reason == "time_limit":
            return {**value, "time_limit": True}
        return {**value, "cancelled": True, "preempted": False} if reason == "terminated" else value
    lines = str(value).strip().splitlines()
    return "failed: " + (lines[-1] if lines else "unknown error")


def format_result(result: tp.Any) -> str:
    """One line for people: steps, loss from first to last, throughput, ranks and strategy."""
    if not isinstance(result, dict) or "steps" not in result:
        return str(result)
    stop = (" (stopped at the time limit)" if result.get("time_limit") else
            " (cancelled)" if result.get("cancelled") else
            " (stopped for a preemption)" if result.get("preempted") else "")
    if result.get("final_loss") is None:  # stopped before its first metrics line
        return f"{result['steps']} steps{stop}, no loss logged, {result.get('world_size')} ranks, {result.get('strategy')}"
    losses = result.get("losses") or [result["final_loss"]]
    rate = f", {result['tokens_per_s']:,.0f} tokens/s (median after warm-up)" if result.get("tokens_per_s") else ""
    evaluated = eval_text(result, ", ")
    return (f"{result['steps']} steps{stop}, loss {losses[0]:.4f} -> {result['final_loss']:.4f}{rate}"
            f"{evaluated}, {result['world_size']} ranks, {result['strategy']}")


def run_roots() -> list[Path]:
    """Every site profile's run root (``hpc.login.status.run_roots``), a profile that fails to load named
    on stderr."""
    return roots(lambda message: click.echo(message, err=True))


@cli.command()
@click.argument("ref", required=False, metavar="[RUN|JOB]")
@json_option
def status(ref: str | None, as_json: bool) -> None:
    """State, nodes, step and restarts of a run (by folder, name or job id), or the recent runs.

    The list asks each scheduler once for all its runs and waits at most a few seconds: a run whose
    scheduler does not answer shows "unknown (scheduler unreachable)".
    """
    from hpc.core import runs  # lazy: startup
    from hpc.login import status as listing, submit as sub  # lazy: startup

    if ref:  # one run: a folder that lies about itself is an error line; in the list it is a row
        target = runs.find_run(ref, run_roots())
        infos = [sub.summary(target, sub.job_states([target], sub.QUERY_TIMEOUT_S)[target])]
        infos[0]["goodput"] = sub.goodput(target)  # one run: its metrics are read whole (not in the list)
    else:  # the list (the console script prints a bare `hpcx status` without Click: hpc.entry)
        infos = listing.recent(lambda message: click.echo(message, err=True))
    if as_json:
        echo_json(infos[0] if ref else infos)
        return
    for info in infos:
        click.echo(format_status(info))


@cli.command()
@click.argument("ref", metavar="RUN")
@click.option("-f", "--follow", "follow_", is_flag=True, help="Keep printing until the job ends.")
@click.option("--rank", default=0, show_default=True, help="Which rank's log.")
def logs(ref: str, follow_: bool, rank: int) -> None:
    """Print a rank's log (the trainer's log, else submitit's stdout/stderr for that task)."""
    from hpc.core import runs  # lazy: startup

    from hpc.login import submit as sub  # lazy: startup
    run_dir = runs.find_run(ref, run_roots())
    check_rank(run_dir, rank)
    offsets: dict[Path, int] = {}
    while True:
        for path in log_files(run_dir, rank):
            offsets[path] = print_new(path, offsets.get(path, 0))
        if not follow_ or sub.job_state(run_dir).done:
            break
        time.sleep(1.0)
    if not offsets and not follow_:
        click.echo(f"rank {rank} of {run_dir.name} has written no log yet ({sub.job_state(run_dir).words})", err=True)


def check_rank(run_dir: Path, rank: int) -> None:
    """ConfigError naming the run's ranks when ``rank`` is not one of them (the resolved world size,
    and any rank that left a log, e.g. a torchrun start at another size)."""
    from hpc.core.runs import RunDir  # lazy: startup

    rd = RunDir(run_dir)
    world = rd.read_resolved().get("launch", {}).get("world_size")
    logged = {int(p.stem.split("-", 1)[1]) for p in rd.logs.glob("rank-*.log") if p.stem.split("-", 1)[1].isdigit()}
    ranks = set(range(world)) | logged if isinstance(world, int) else logged
    if rank in ranks or not ranks:
        return
    span = f"0-{max(ranks)}" if ranks == set(range(max(ranks) + 1)) else ", ".join(map(str, sorted(ranks)))
    size = f"{world} ranks" if isinstance(world, int) else f"{len(ranks)} ranks with logs"
    raise ConfigError([f"--rank {rank}: {run_dir.name} has {size} ({span})"])


def log_files(run_dir: Path, rank: int) -> list[Path]:
    from hpc.core.runs import RunDir  # lazy: startup

    rd = RunDir(run_dir)
    if rd.rank_log(rank).exists():
        return [rd.rank_log(rank)]
    return sorted(rd.submitit.glob(f"*_{rank}_log.*"))


def print_new(path: Path, offset: int) -> int:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    if data:
        sys.stdout.write(data.decode("utf-8", errors="replace"))
        sys.stdout.flush()
    return offset + len(data)


@cli.command()
@click.argument("ref", metavar="RUN")
def cancel(ref: str) -> None:
    """Cancel a run's job: its ranks stop at their next step boundary, write the ledger's stop line
    and save nothing new (Slurm: scancel; a cancel is never treated as a preemption, never requeued)."""
    from hpc.core import runs  # lazy: startup

    from hpc.login import submit as sub  # lazy: startup
    click.echo(sub.cancel(runs.find_run(ref, run_roots())))


@cli.command()
@click.argument("ref", metavar="RUN")
@click.option("--at-step", "at_step", default=None, metavar="N", help="First wait until metrics.jsonl shows step ≥ N.")
@click.option("--hang", "hang", default=None, metavar="RANK", help="Stop that rank (SIGSTOP): the hang watchdog's path.")
@click.option("--slow", "slow", default=None, metavar="RANK", help="Stop that rank half of each second for "
              "--for seconds: a straggler.")
@click.option("--for", "slow_s", default=120, type=click.IntRange(1, 86400), metavar="SECONDS",
              help="How long --slow lasts (default 120).")
@click.option("--fail-node", "fail_node", is_flag=True, help="Kill (SIGKILL) every rank on the node of the last "
              "rank: a node failure, excluded on the requeue.")
@json_option
def drill(ref: str, at_step: str | None, hang: str | None, slow: str | None, slow_s: int, fail_node: bool,
          as_json: bool) -> None:
    """Rehearse a preemption: send the job's tasks USR2 (Slurm: scancel --signal=USR2); or a fault.

    Waits until the job is training (and, with --at-step, has reached step N). The trainer then
    saves at the next step boundary, requeues itself once and resumes from that checkpoint. With
    --hang, --slow or --fail-node (one of them), the fault instead, at one rank's process on its node.
    """
    from hpc.core import runs  # lazy: startup
    from hpc.login.drill import drill as send_drill, parse_step  # lazy: startup

    step = parse_step(at_step)
    run_dir = runs.find_run(ref, run_roots())
    def on_wait(message: str) -> None:
        if not as_json:
            click.echo(message, err=True)

    if hang is not None or slow is not None or fail_node:
        _drill_fault(run_dir, step, hang, slow, slow_s, fail_node, as_json, on_wait)
        return
    done = send_drill(run_dir, step, on_wait=on_wait)
    if as_json:
        echo_json(done)
        return
    at = f" at step {done['step']}" if done["step"] is not None else ""
    click.echo(f"drilled job {done['job_id']}{at}: sent {done['signal']} to {', '.join(done['targets'])}")


def _drill_fault(run_dir: Path, step: int | None, hang: str | None, slow: str | None, slow_s: int, fail_node: bool,
                 as_json: bool, on_wait: tp.Callable[[str], None]) -> None:
    """``hpcx drill --hang/--slow/--fail-node``: one fault, at a rank of the run."""
    from hpc.core import runs  # lazy: startup
    from hpc.login.drill import drill_fault, parse_rank  # lazy: startup

    given = [name for name, value in (("--hang", hang), ("--slow", slow), ("--fail-node", fail_node)) if value]
    if len(given) > 1:
        raise UserError([f"{' and '.join(given)}: expected one fault per drill"])
    world = int(runs.RunDir(run_dir).read_resolved().get("launch", {}).get("world_size") or 1)
    rank = parse_rank(hang if hang is not None else slow, given[0], world)
    fault = "hang" if hang is not None else "slow" if slow is not None else "fail_node"
    done = drill_fault(run_dir, fault, world - 1 if rank is None else rank, step, float(slow_s), on_wait=on_wait)
    if as_json:
        echo_json(done)
        return
    at = f" at step {done['step']}" if done["step"] is not None else ""
    click.echo(f"drilled job {done['job_id']}{at}: {fault.replace('_', ' ')} at rank {done['rank']} on {done['host']} "
               f"({'; '.join(done['targets'])})")


@cli.group(cls=LazyGroup, lazy={"detect": ("hpc.cli.plan", "detect_command")})
def site() -> None:
    """Site profiles: list, show, detect."""


@site.command("list")
@json_option
def site_list(as_json: bool) -> None:
    """The site profiles on the search path, and where each came from.

    Search path: $HPCX_SITE_PATH (folders separated by ':'), ~/.config/hpcx/sites, /etc/hpcx/sites,
    then the profiles bundled with hpcx; the first profile of a name wins.
    """
    from hpc.core.site import find_sites  # lazy: startup

    rows = [_site_row(name, path, origin) for name, (path, origin) in find_sites().items()]
    if as_json:
        echo_json(rows)
        return
    for r in rows:
        where = f"[{r['origin']}: {r['path']}]"
        if r["error"]:  # a file name on the search path may hold anything
            click.echo(shown(f"{r['name']:12} (does not load: {r['error']})  {where}", 4000))
            continue
        gpus = f"{r['gpus_per_node']}× {r['gpu_model']}" if r["gpus_per_node"] else f"CPU ×{r['tasks_per_node']}"
        click.echo(f"{r['name']:12} {r['scheduler']:6} {gpus:28} {r['intra_link']:9} {r['fabric']:11} {where}")


@cli.command()
@click.argument("job", type=click.Path(dir_okay=False))
@site_option
@set_option
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="The rank to build (its mesh coordinate, shards and checkpoint plan).")
@click.option("--strict", is_flag=True, help="Refuse (exit 2) when the plan estimates that the spec's layout does "
              "not fit in memory.")
@json_option
def dryrun(job: str, site_name: str | None, overrides: tuple[str, ...], rank: int, strict: bool, as_json: bool) -> None:
    """Build JOB's real sharded model, mesh and optimizer as one rank of the full job, on this CPU.

    The trainer's own construction runs on torch's fake process group: no GPU, no weights (every
    tensor is on the meta device). Prints the mesh, the FSDP units and the bytes per rank beside
    `hpcx plan`'s, and this rank's checkpoint plan. Imports torch (unlike render and plan).
    Exit status 1 when dryrun and plan differ by more than 1%.
    """
    spec, site, launch = load_job(job, site_name, overrides)
    refuse_script_mode(spec, "dryrun")
    check_memory(spec, site, launch, strict)
    check_init_from(spec)
    if rank >= launch.world_size:
        raise ConfigError([f"--rank {rank}: {spec.source} runs {launch.nodes} node(s) × {launch.tasks_per_node} "
                           f"ranks = {launch.world_size} ranks, expected 0..{launch.world_size - 1}"])
    from hpc.core import imports  # lazy: startup

    imports.check()  # before the trainer is imported
    from hpc.dryrun import dryrun as dry, format_dryrun  # lazy: torch

    result = dry(spec, site, launch, rank)
    if as_json:
        echo_json(result.to_dict())
    else:
        click.echo(format_dryrun(result))
    if result.problems:
        sys.exit(1)


def _site_row(name: str, path: Path, origin: str) -> dict[str, tp.Any]:
    """One line of `site list`: the profile's headline fields, or why it does not load."""
    from hpc.core.site import load_site  # lazy: startup

    row: dict[str, tp.Any] = {"name": name, "path": str(path), "origin": origin, "error": None}
    try:
        p = load_site(name)
    except ConfigError as exc:
        return {**row, "error": exc.messages[0]}
    return {**row, "scheduler": p.scheduler.kind, "gpus_per_node": p.node.gpus, "gpu_model": p.node.gpu_model,
            "tasks_per_node": p.default_tasks_per_node(), "intra_link": p.node.intra_link,
            "fabric": p.network.fabric}


@site.command("show")
@click.argument("name")
@json_option
def site_show(name: str, as_json: bool) -> None:
    """One profile with every field resolved (NAME or a path)."""
    from hpc.core.site import load_site, site_as_dict  # lazy: startup

    doc = site_as_dict(load_site(name))
    if as_json:
        echo_json(doc)
        return
    for section, values in doc.items():
        if isinstance(values, dict):
            click.echo(f"[{section}]")
            for key, value in values.items():
                click.echo(f"  {key} = {json.dumps(value)}")
        else:
            click.echo(f"{section} = {json.dumps(values)}")


def main() -> None:
    cli(prog_name="hpcx")
