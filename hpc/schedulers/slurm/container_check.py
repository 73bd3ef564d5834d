"""``hpcx container check --site S``: a short job on one node, two tasks in the site's image
(``trainer.probe``), through the same step as a training job (``hpc.schedulers.slurm.container``)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import time
import typing as tp
from pathlib import Path

from hpc.core.container import Container, identity, overlay_links, step_mounts, submit_problems
from hpc.core.errors import UserError
from hpc.core.imports import python_command
from hpc.core.nccl import describe, parse_files
from hpc.schedulers.base import try_command
from hpc.schedulers.slurm.container import Wrapped, inner_python, prepare_run, wrap_step

TASKS = 2
CHECK_MINUTES = 10


def check_script(step: Wrapped, folder: Path) -> str:
    srun = ["srun", "--nodes=1", f"--ntasks={TASKS}", f"--output={folder}/task-%t.out",
            f"--error={folder}/task-%t.err", *step.srun_args]
    return "\n".join(["#!/bin/bash", "export NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,GRAPH", *step.setup,
                      f"{shlex.join(srun)} {shlex.join(step.argv)}", ""])


def run_check(site: tp.Any, timeout: float = 900) -> dict[str, tp.Any]:
    """Submit the check, wait for it, and gather what each task saw (``trainer.probe``) and NCCL's transports."""
    c: Container = site.container
    if c.enabled:
        found = submit_problems(c, site.source)
        if found:
            raise UserError(found)
    folder = site.run_root() / f"container-check-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    folder.mkdir(parents=True)
    workdir = os.getcwd()
    if c.enabled:
        try:
            links = overlay_links()
            mounts = step_mounts(c, str(folder.parent), workdir, links)
            prepare_run(c, folder, workdir, gpus=site.node.gpus, where=f"{site.source}: `container.image`",
                        source=site.source, links=links, mounts=mounts)
        except UserError:
            shutil.rmtree(folder, ignore_errors=True)  # nothing left behind by a check that never ran
            raise
        inner = inner_python(c, str(folder))
        argv = [*inner[:-1], *python_command(inner[-1], "trainer.probe", str(folder))]
        step = wrap_step(argv, c, str(folder), mounts, workdir, bool(site.node.gpus))
    else:
        step = Wrapped((), tuple(python_command(sys.executable, "trainer.probe", str(folder))))
    script = folder / "check.sh"
    script.write_text(check_script(step, folder))
    options = ["--parsable", "--wait", "--job-name=hpcx-container-check", "--nodes=1", f"--ntasks={TASKS}",
               f"--time={CHECK_MINUTES}", f"--output={folder}/batch.out", "--no-requeue"]
    options += [f"--gres=gpu:{TASKS}"] if site.node.gpus and site.scheduler.gpu_directive == "gres" else []
    options += [f"--gpus-per-node={TASKS}"] if site.node.gpus and site.scheduler.gpu_directive == "gpus-per-node" else []
    for key in ("partition", "account", "qos"):
        if getattr(site.scheduler, key, None):
            options.append(f"--{key}={getattr(site.scheduler, key)}")
    ok, out = try_command(["sbatch", *options, str(script)], timeout=timeout)
    return gather(folder, ok, out, c)


def gather(folder: Path, ok: bool, out: str, c: tp.Any) -> dict[str, tp.Any]:
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]
    info = parse_files(sorted(folder.glob("task-*.err")))
    transports = sorted(info.transports())
    lines = [line for p in sorted(folder.glob("task-*.err")) for line in p.read_text(errors="replace").splitlines()]
    images = [line.removeprefix("hpcx: ") for line in lines if line.startswith("hpcx: image ")]  # versions_line
    errors = [line for line in lines if not line.startswith("hpcx: image ") and (
        line.startswith(("hpcx:", "srun: error", "Traceback")) or "error" in line.lower())][:10]
    refused = next((line.removeprefix("hpcx: ") for line in errors if line.startswith("hpcx: the container image ")),
                   None)
    return {"folder": str(folder), "job_ok": ok, "sbatch": out.strip()[-500:], "container": identity(c),
            "images": sorted(set(images)), "refused": refused,
            "ranks": ranks, "nccl": describe(info) if info.connections else None, "transports": transports,
            "errors": errors, "ok": ok and len(ranks) == TASKS and all(r.get("all_reduce_ok") and
                                                                      r.get("hpcx_imports") == "ok" for r in ranks)}
