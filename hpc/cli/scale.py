"""``hpcx scale``: scaling studies from the command line (no torch, no matplotlib at import).

    hpcx scale JOB --nodes 1,2,4,8 [--mode weak|strong] [--steps N] [--site S] [--set K=V] [--wait]
    hpcx scale report STUDY [--site-draft FILE] [--json]
    hpcx scale predict JOB --site S --nodes 1,2,4,...,1024 [--mode weak|strong] [--json]

``hpcx scale JOB …`` is short for ``hpcx scale run JOB …``: when the first word after ``scale`` is
not a subcommand, ``run`` is meant (a spec file literally named ``report`` needs ``scale run report``).
"""

from __future__ import annotations

from pathlib import Path

import click

from hpc.core.config import ConfigError
from hpc.cli.clickutil import ErrorsGroup, echo_json, json_option, set_option, site_option



class ScaleGroup(ErrorsGroup):
    """A group whose first word defaults to ``run``; ConfigError becomes ``error:`` lines and exit code 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("-h", "--help"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


@click.group("scale", cls=ScaleGroup)
def scale_group() -> None:
    """Scaling studies: run JOB at several node counts, then report measured against predicted.

    \b
    hpcx scale JOB --nodes 1,2,4,8 [--mode weak|strong] [--wait]   (same as `hpcx scale run JOB …`)
    hpcx scale report STUDY
    hpcx scale predict JOB --site S --nodes 1,2,4,…,1024
    """


nodes_option = click.option("--nodes", "nodes_text", required=True, metavar="N,N,…",
                            help="Node counts, comma-separated, e.g. 1,2,4,8.")
mode_option = click.option("--mode", type=click.Choice(["weak", "strong"]), default="weak", show_default=True,
                           help="weak: keep the per-rank batch; strong: keep train.global_batch.")


@scale_group.command("run")
@click.argument("job", type=click.Path(dir_okay=False))
@nodes_option
@mode_option
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Override train.steps for every point.")
@site_option
@set_option
@click.option("--wait", is_flag=True, help="Follow the jobs until all have ended, then print the report.")
@json_option
def run_command(job: str, nodes_text: str, mode: str, steps: int | None, site_name: str | None,
                overrides: tuple[str, ...], wait: bool, as_json: bool) -> None:
    """Submit one job per node count under one study folder; returns at once unless --wait."""
    from hpc import scale  # lazy: startup
    from hpc.core.site import select_site  # lazy: startup
    from hpc.core.spec import load_spec  # lazy: startup

    site = select_site(site_name, load_spec(job, overrides))
    study_dir = scale.start_study(Path(job), site, overrides, scale.parse_nodes(nodes_text), mode, steps)
    points = scale.read_study(study_dir)["points"]
    if not as_json:
        click.echo(f"study {study_dir} ({mode} scaling, site {site.name})")
        for p in points:
            click.echo(f"  {p['nodes']:>4} nodes  {p['ranks']:>5} ranks  global_batch {p['global_batch']:<6} "
                       + (f"job {p['job_id']}" if p["job_id"] else p["error"]))
        click.echo(f"report: hpcx scale report {study_dir}")
    if wait:
        def show(point: dict, state: str) -> None:
            if not as_json:
                click.echo(f"  {point['nodes']} nodes: {state}", err=True)

        scale.follow_study(study_dir, show)
        print_report(study_dir, as_json)
    elif as_json:
        echo_json({"study": str(study_dir), "points": points})


@scale_group.command("report")
@click.argument("study", type=click.Path(file_okay=False))
@click.option("--site-draft", type=click.Path(dir_okay=False), default=None,
              help="Write the study's site profile with the measured node.mfu to this new file.")
@json_option
def report_command(study: str, site_draft: str | None, as_json: bool) -> None:
    """Table, report.csv, report.md and report.png of a study (partial studies too)."""
    print_report(Path(study), as_json, Path(site_draft) if site_draft else None)


def write_mfu_draft(study_dir: Path, report: dict, path: Path) -> str:
    """The measured MFU into a site draft at ``path``; the line that says so."""
    from hpc.scale.mfu import study_mfu  # lazy: startup
    from hpc.scale.report import study_site  # lazy: startup
    from hpc.scale.study import read_study  # lazy: startup
    from hpc.core.site_draft import write_draft  # lazy: startup

    found = study_mfu(study_dir, report)
    if found is None:
        raise ConfigError([f"{study_dir}: no measured point with a known peak FLOP/s: no MFU to write"])
    drafted = write_draft(path, study_site(read_study(study_dir)), *found)
    return f"site draft {path}: node.mfu = {drafted.node.mfu} ({drafted.node.mfu_source})"


def print_report(study_dir: Path, as_json: bool, site_draft: Path | None = None) -> None:
    from hpc import scale  # lazy: startup

    report = scale.build_report(study_dir)
    if site_draft is not None:
        report["site_draft"] = write_mfu_draft(study_dir, report, site_draft)
        click.echo(report["site_draft"], err=True)
    report["files"], report["warnings"] = scale.write_report(report, study_dir, report["group_readable"])
    for warning in report["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    if as_json:
        echo_json(report)
        return
    click.echo(f"{report['name']}: {report['mode']} scaling on {report['site']}  ({study_dir})")
    for line in scale.table_lines(report) + scale.notes(report):
        click.echo(line)
    click.echo("written: " + ", ".join(report["files"].values()))


@scale_group.command("predict")
@click.argument("job", type=click.Path(dir_okay=False))
@nodes_option
@mode_option
@site_option
@set_option
@json_option
def predict_command(job: str, nodes_text: str, mode: str, site_name: str | None, overrides: tuple[str, ...],
                    as_json: bool) -> None:
    """The planner's model alone at each size: no jobs, no cluster needed."""
    from hpc import scale  # lazy: startup
    from hpc.core.site import select_site  # lazy: startup
    from hpc.core.spec import load_spec  # lazy: startup

    spec = load_spec(job, overrides)
    site = select_site(site_name, spec)
    rows = scale.predict_table(spec, site, scale.parse_nodes(nodes_text), mode)
    if as_json:
        echo_json({"site": site.name, "mode": mode, "points": rows})
        return
    from hpc.plan import mfu_of  # lazy: startup

    mfu, source = mfu_of(site)
    click.echo(f"{spec.job.name}: {mode} scaling predicted on {site.name} (NCCL-model communication + compute at "
               f"{mfu:.0%} of peak, {source}; no overlap)")
    for line in predict_lines(rows):
        click.echo(line)


def predict_lines(rows: list[dict]) -> list[str]:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}"

    out = [f"{'nodes':>6} {'ranks':>6} {'batch':>7} {'compute ms':>11} {'comm ms':>9} {'tok/s':>13} {'eff':>5}"
           "  limiting link"]
    for r in rows:
        if r.get("error"):
            out.append(f"{r['nodes']:>6}  {r['error']}")
            continue
        tps = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}"
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.0%}"
        out.append(f"{r['nodes']:>6} {r['ranks']:>6} {r['global_batch']:>7} {ms(r['compute_s']):>11} "
                   f"{ms(r['comm_s']):>9} {tps:>13} {eff:>5}  {r['limiting_link']}")
    return out
