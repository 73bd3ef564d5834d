"""Slurm for ``hpcx data prepare --site S``: one job array (one task per group of inputs) and one merge
job that waits for it (``afterok``). Options go to sbatch as arguments, never as ``#SBATCH`` lines, so
no value meets the directive parser; the scripts only run hpcx's own job-side module with the
interpreter of the submitting shell (the nodes share its file system)."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import typing as tp
from pathlib import Path

from hpc.core.container import mount_problems, overlay_links, step_mounts
from hpc.core.errors import UserError
from hpc.core.imports import python_command
from hpc.schedulers.base import try_command
from hpc.schedulers.slurm.container import inner_python, prepare_run, wrap_step

SUBMIT_TIMEOUT_S = 60.0
ARRAY_MINUTES = 240  # per array task; a group of 256 MiB takes minutes on one core


def job_script(python: str, args: tp.Sequence[str], step: tp.Callable[[list[str]], tp.Any] | None = None) -> str:
    """A two-line batch script running ``python -m hpc.data.task ARGS`` ("$SLURM_ARRAY_TASK_ID" kept as is),
    as ``python -c BOOT hpc.data.task ARGS`` (``hpc.core.imports``: not the submit folder's ``hpc``). With
    ``step`` (the site's container: ``container.Step`` for an argv), the same command in the image: run by
    ``srun --ntasks=1`` where the runtime is a flag of srun's."""
    argv = python_command(python, "hpc.data.task", *args)
    srun: list[str] = []
    if step is not None:
        wrapped = step(argv)
        argv = wrapped.argv
        srun = ["srun", "--ntasks=1", *wrapped.srun_args] if wrapped.srun_args else []
    words = " ".join(a if a == '"$SLURM_ARRAY_TASK_ID"' else shlex.quote(a) for a in [*srun, *argv])
    return f"#!/bin/bash\nexec {words}\n"


def container_step(c: tp.Any, folder: Path) -> tp.Callable[[list[str]], tp.Any] | None:
    """The preparation's tasks in container ``c`` (None without one): the output folder read-write, the
    inputs' and the tokenizer's folders read-only, hpcx's overlay and bundle under ``folder/.prepare``."""
    if not c.enabled:
        return None
    plan = json.loads((folder / ".prepare" / "plan.json").read_text())
    reads = sorted({os.path.dirname(os.path.abspath(i["path"])) for i in plan["inputs"]}
                   | {os.path.dirname(os.path.abspath(plan["tokenizer"]["path"]))})
    extra = [f"{d}:{d}:ro" for d in reads]
    bad = [p for m in extra for p in mount_problems(m, "an input folder")]
    if bad:
        raise UserError(bad)
    c = dataclasses.replace(c, mounts=[*c.mounts, *extra])
    run_dir, workdir = folder / ".prepare", os.getcwd()
    links = overlay_links()
    mounts = step_mounts(c, str(folder), workdir, links)
    prepare_run(c, run_dir, workdir, links=links, mounts=mounts)

    def step(argv: list[str]) -> tp.Any:
        inner = inner_python(c, str(run_dir))
        return wrap_step([*inner[:-1], inner[-1], *argv[1:]], c, str(run_dir), mounts, workdir)

    return step


def sbatch_options(scheduler: tp.Any, name: str, log: str, cpus: int, minutes: int) -> list[str]:
    """The sbatch arguments every job of a preparation shares (site partition/account/qos when set)."""
    out = ["--parsable", f"--job-name={name}", "--ntasks=1", f"--cpus-per-task={cpus}", f"--time={minutes}",
           f"--output={log}", "--no-requeue"]
    for key in ("partition", "account", "qos"):
        if getattr(scheduler, key, None):
            out.append(f"--{key}={getattr(scheduler, key)}")
    return out


def submit(script: Path, options: list[str]) -> str:
    """``sbatch OPTIONS SCRIPT``; the job id (a UserError with sbatch's words when it refuses)."""
    ok, out = try_command(["sbatch", *options, str(script)], timeout=SUBMIT_TIMEOUT_S)
    if not ok:
        raise UserError([f"sbatch {script}: {out.strip().splitlines()[-1] if out.strip() else 'failed'}"])
    return out.strip().split(";")[0]


def submit_prepare(folder: Path, scheduler: tp.Any, python: str, groups: list[int], cpus: int,
                   minutes: int, container: tp.Any = None) -> tuple[str, str]:
    """(array job id, merge job id) for the unfinished ``groups`` of the preparation in ``folder``; with the
    site's ``container``, every task runs in its image."""
    state = folder / ".prepare"
    (state / "logs").mkdir(exist_ok=True)
    array, merge = state / "array.sh", state / "merge.sh"
    step = container_step(container, folder) if container is not None else None
    array.write_text(job_script(python, ["group", str(folder), '"$SLURM_ARRAY_TASK_ID"'], step))
    merge.write_text(job_script(python, ["merge", str(folder)], step))
    common = sbatch_options(scheduler, "hpcx-prepare", str(state / "logs" / "group-%a.out"), cpus, minutes)
    array_id = submit(array, common + [f"--array={','.join(map(str, groups))}"])
    merge_options = sbatch_options(scheduler, "hpcx-prepare-merge", str(state / "logs" / "merge.out"), 1, minutes)
    merge_id = submit(merge, merge_options + [f"--dependency=afterok:{array_id}", "--kill-on-invalid-dep=yes"])
    return array_id, merge_id
