"""One package per scheduler kind behind one interface (``hpc.schedulers.base``); this is the registry.

``get(kind)`` gives the login side of a site's scheduler (``site.scheduler.kind``); ``job_side()``
gives the side of whichever scheduler started this process, or None when none did (torchrun, or a
plain process: nobody can requeue it); ``rank_env`` reads a task a scheduler started itself (a plain
srun step). ``section_problems`` and ``site_problems`` are each kind's rules on a site's
``[scheduler]`` section; ``LIMITS`` the strictest of each kind's integer limits (``<kind>/limits.py``).

A kind is a package ``hpc/schedulers/<kind>/``: ``scheduler.py`` (its ``Scheduler`` and ``JobSide``),
``executor.py`` (submitit's executor, imported only to submit), optionally ``limits.py``, and whatever
else it needs. Adding one is that package and a line in ``KINDS``; nothing else branches on the kind.
"""

from __future__ import annotations

import importlib
import os
import typing as tp

from hpc.schedulers.base import (SUBMITIT_DIR, TERMINAL, JobSide, JobState, RankEnv, Scheduler,
                                 rendezvous_port)

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.site import SiteProfile

# kind -> (module, login-side class, job-side class)
KINDS = {"slurm": ("hpc.schedulers.slurm.scheduler", "SlurmScheduler", "SlurmJobSide"),
         "local": ("hpc.schedulers.local.scheduler", "LocalScheduler", "LocalJobSide")}
# kinds with integer limits on what a spec or site may ask (``<kind>/limits.py``, importing nothing)
LIMITED = ("slurm",)

__all__ = ["KINDS", "LIMITS", "SUBMITIT_DIR", "TERMINAL", "JobSide", "JobState", "RankEnv", "Scheduler", "get",
           "job_side", "rank_env", "rendezvous_port", "section_problems", "site_problems"]


def _limits() -> dict[str, int]:
    """Each bounded field's smallest limit over the kinds (read when the spec and site schemas are built)."""
    found: dict[str, int] = {}
    for kind in LIMITED:
        for name, value in importlib.import_module(f"hpc.schedulers.{kind}.limits").LIMITS.items():
            found[name] = min(value, found.get(name, value))
    return found


LIMITS = _limits()


def _load(kind: str, index: int) -> type:
    module, *classes = KINDS[kind]
    return getattr(importlib.import_module(module), classes[index])


def get(kind: str) -> Scheduler:
    """The login side of scheduler ``kind`` (one of ``KINDS``)."""
    return _load(kind, 0)()


def job_side() -> JobSide | None:
    """The scheduler that started this task (each kind's ``JobSide.started_this_task``), else None."""
    for kind in KINDS:
        side = _load(kind, 1)
        if side.started_this_task(os.environ):
            return side()
    return None


def rank_env(env: tp.Mapping[str, str]) -> RankEnv | None:
    """This task's rank, world and rank 0's address, when a scheduler started it itself (a task of a
    plain srun step, no submitit, no torchrun); None otherwise."""
    for kind in KINDS:
        found = _load(kind, 1).rank_env(env)
        if found is not None:
            return found
    return None


def section_problems(section: tp.Any) -> list[str]:
    """Every kind's rules on the options it owns in a site's ``[scheduler]`` section (Slurm's sbatch
    table), on well-typed fields."""
    return [problem for kind in KINDS for problem in _load(kind, 0).section_problems(section)]


def site_problems(site: SiteProfile) -> list[str]:
    """The site's own kind's cross-checks of a well-typed profile (Slurm's GPU directive on a GPU site)."""
    return get(site.scheduler.kind).site_problems(site)
