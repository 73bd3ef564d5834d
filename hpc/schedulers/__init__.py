"""One module per scheduler behind one interface (``hpc.schedulers.base``).

``get(kind)`` gives the login side of a site's scheduler (``site.scheduler.kind``); ``job_side()``
gives the side of whichever scheduler started this process, or None when none did (torchrun, or a
plain process: nobody can requeue it). ``hpc.schedulers.executors`` holds submitit's executors with
hpcx's task command (imported only to submit). Adding a scheduler is adding a module and a line in ``KINDS``.
"""

from __future__ import annotations

import importlib
import os

from hpc.schedulers.base import SUBMITIT_DIR, TERMINAL, JobSide, JobState, Scheduler

# kind -> (module, login-side class, job-side class)
KINDS = {"slurm": ("hpc.schedulers.slurm.scheduler", "SlurmScheduler", "SlurmJobSide"),
         "local": ("hpc.schedulers.local.scheduler", "LocalScheduler", "LocalJobSide")}

__all__ = ["KINDS", "SUBMITIT_DIR", "TERMINAL", "JobSide", "JobState", "Scheduler", "get", "job_side"]


def _load(kind: str, index: int) -> type:
    module, *classes = KINDS[kind]
    return getattr(importlib.import_module(module), classes[index])


def get(kind: str) -> Scheduler:
    """The login side of scheduler ``kind`` (one of ``KINDS``)."""
    return _load(kind, 0)()


def job_side() -> JobSide | None:
    """The scheduler that started this task: submitit tells (``SUBMITIT_EXECUTOR``); a task of a plain
    ``srun`` (a Slurm step, no torchrun) is Slurm's too; else None."""
    env = os.environ
    executor = env.get("SUBMITIT_EXECUTOR", "")
    if not executor and env.get("SLURM_STEP_ID") and "RANK" not in env:
        executor = "slurm"
    if executor == "slurm" and not env.get("SLURM_JOB_ID"):
        return None
    return _load(executor, 1)() if executor in KINDS else None
