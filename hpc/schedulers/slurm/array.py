"""Slurm for ``hpcx data prepare --site S``: one job array (one task per group of inputs) and one merge
job that waits for it (``afterok``). Options go to sbatch as arguments, never as ``#SBATCH`` lines, so
no value meets the directive parser; the scripts only run hpcx's own job-side module with the
interpreter of the submitting shell (the nodes share its file system)."""

from __future__ import annotations

import shlex
import typing as tp
from pathlib import Path

from hpc.core.errors import UserError
from hpc.schedulers.base import try_command

SUBMIT_TIMEOUT_S = 60.0
ARRAY_MINUTES = 240  # per array task; a group of 256 MiB takes minutes on one core


def job_script(python: str, args: tp.Sequence[str]) -> str:
    """A two-line batch script running ``python -m hpc.data.task ARGS`` ("$SLURM_ARRAY_TASK_ID" kept as is),
    as ``python -c BOOT hpc.data.task ARGS`` (``hpc.core.imports``: not the submit folder's ``hpc``)."""
    from hpc.core.imports import python_command

    words = " ".join(a if a == '"$SLURM_ARRAY_TASK_ID"' else shlex.quote(a)
                     for a in python_command(python, "hpc.data.task", *args))
    return f"#!/bin/bash\nexec {words}\n"


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
                   minutes: int) -> tuple[str, str]:
    """(array job id, merge job id) for the unfinished ``groups`` of the preparation in ``folder``."""
    state = folder / ".prepare"
    (state / "logs").mkdir(exist_ok=True)
    array, merge = state / "array.sh", state / "merge.sh"
    array.write_text(job_script(python, ["group", str(folder), '"$SLURM_ARRAY_TASK_ID"']))
    merge.write_text(job_script(python, ["merge", str(folder)]))
    common = sbatch_options(scheduler, "hpcx-prepare", str(state / "logs" / "group-%a.out"), cpus, minutes)
    array_id = submit(array, common + [f"--array={','.join(map(str, groups))}"])
    merge_options = sbatch_options(scheduler, "hpcx-prepare-merge", str(state / "logs" / "merge.out"), 1, minutes)
    merge_id = submit(merge, merge_options + [f"--dependency=afterok:{array_id}", "--kill-on-invalid-dep=yes"])
    return array_id, merge_id
