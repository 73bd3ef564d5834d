"""``hpcx container check --site S``: what a task sees inside the site's image (torch-free here)."""

from __future__ import annotations

import importlib
import typing as tp

import click

from hpc.cli.clickutil import echo_json, json_option
from hpc.core.errors import UserError


@click.group("container")
def container_group() -> None:
    """The site's container image ([container] in the site profile; docs/containers.md)."""


@container_group.command("check")
@click.option("--site", "site_name", required=True, metavar="S", help="Site profile name or path.")
@json_option
def check_command(site_name: str, as_json: bool) -> None:
    """Run two tasks on one node inside the site's image: Python/torch/CUDA/NCCL versions, the GPUs they
    see, whether hpcx's code imports there, and the transports a 2-rank all-reduce chose (NCCL's INFO lines)."""
    from hpc.core.site import load_site  # lazy: startup

    site = load_site(site_name)
    try:
        module = importlib.import_module(f"hpc.schedulers.{site.scheduler.kind}.container_check")
    except ModuleNotFoundError:
        raise UserError([f"{site.source}: scheduler {site.scheduler.kind!r} runs no container check "
                         "(a site with a batch scheduler does)"]) from None
    report = module.run_check(site)
    if as_json:
        echo_json(report)
    elif report.get("refused"):  # the image's own check refused it: what it holds, then the one line
        for line in report.get("images", []):
            click.echo(line)
        raise UserError([f"{site.source}: {report['refused']}"])
    else:
        click.echo(summary(report))
    if not report["ok"]:
        raise SystemExit(2 if report.get("refused") else 1)


def summary(report: dict[str, tp.Any]) -> str:
    c = report["container"]
    lines = [f"image: {c.get('image') or '(none: the nodes own Python)'} (runtime {c['runtime']})"]
    lines += [f"  {line}" for line in report.get("images", [])]
    for r in report["ranks"]:
        lines.append(f"  {r.get('host')}: python {r.get('python')} ({r.get('executable')}), torch {r.get('torch')}, "
                     f"CUDA {r.get('cuda') or 'none'}, NCCL {r.get('nccl') or 'none'}, GPUs {len(r.get('gpus', []))}, "
                     f"hpcx imports: {r.get('hpcx_imports')}, all-reduce ({r.get('backend')}): "
                     f"{'ok' if r.get('all_reduce_ok') else r.get('all_reduce_error', 'failed')}")
    lines.append(f"NCCL transports: {', '.join(report['transports']) or 'none (no NCCL lines: a CPU site runs gloo)'}")
    lines += [f"  {e}" for e in report["errors"]]
    lines.append(("ok" if report["ok"] else "FAILED") + f" (files in {report['folder']})")
    return "\n".join(lines)
