"""One package per scheduler kind behind one interface (``hpc.schedulers.base``); this is the registry.

``get(kind)`` gives the login side of a site's scheduler (``site.scheduler.kind``); ``job_side()``
gives the side of whichever scheduler started this process, or None when none did (torchrun, or a
plain process: nobody can requeue it); ``rank_env`` reads a task a scheduler started itself (a plain
srun step). ``section_class`` builds a site's ``[scheduler]`` section from the fields every kind has
and each kind's own (``<kind>/section.py``); ``section_problems`` and ``site_problems`` are each kind's
rules on it; ``path_problem`` each kind's demands of a folder it writes logs to; ``LIMITS`` the
strictest of each kind's integer limits (``<kind>/limits.py``); ``detect_site`` the first kind that
can draft a profile of this machine (``hpcx site detect``).

A kind is a package ``hpc/schedulers/<kind>/``: ``scheduler.py`` (its ``Scheduler`` and ``JobSide``),
``executor.py`` (submitit's executor, imported only to submit), optionally ``limits.py`` and
``section.py`` (both importing nothing heavier than ``hpc.core.config``: a profile loads them), and
whatever else it needs. Adding one is that package and a line in ``KINDS`` (and in ``LIMITED`` or
``SECTIONED``); nothing else branches on the kind.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import typing as tp

from hpc.core.errors import UserError
from hpc.schedulers.base import (SUBMITIT_DIR, TERMINAL, ContainerRuntime, JobSide, JobState, RankEnv, Scheduler,
                                 Step, rendezvous_port)

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.site import SiteProfile

# kind -> (module, login-side class, job-side class)
KINDS = {"slurm": ("hpc.schedulers.slurm.scheduler", "SlurmScheduler", "SlurmJobSide"),
         "local": ("hpc.schedulers.local.scheduler", "LocalScheduler", "LocalJobSide")}
# kinds with integer limits on what a spec or site may ask (``<kind>/limits.py``, importing nothing)
LIMITED = ("slurm",)
# kinds with fields of their own in a site's [scheduler] section (``<kind>/section.py``: ``Section``, and
# optionally ``CROSS_CHECKED``, the fields its ``site_problems`` read, and ``path_problem``)
SECTIONED = ("slurm",)

__all__ = ["ENV_OWNERS", "KINDS", "LIMITS", "SUBMITIT_DIR", "TERMINAL", "ContainerRuntime", "JobSide", "JobState",
           "RankEnv", "Scheduler", "Step", "container_runtime", "container_runtimes", "cross_checked",
           "detect_site", "first_on_node", "get", "job_side", "path_problem", "rank_env", "rendezvous_port", "section_class",
           "section_problems", "site_problems"]


def _limits() -> dict[str, int]:
    """Each bounded field's smallest limit over the kinds (read when the spec and site schemas are built)."""
    found: dict[str, int] = {}
    for kind in LIMITED:
        for name, value in importlib.import_module(f"hpc.schedulers.{kind}.limits").LIMITS.items():
            found[name] = min(value, found.get(name, value))
    return found


LIMITS = _limits()
# name prefix -> who sets it in every task, over the kinds with limits (``<kind>/limits.py``: ENV_PREFIXES)
ENV_OWNERS = {prefix: who for kind in LIMITED
              for prefix, who in getattr(importlib.import_module(f"hpc.schedulers.{kind}.limits"), "ENV_PREFIXES",
                                         {}).items()}


def _sections() -> dict[str, tp.Any]:
    """kind -> its ``section`` module, for the kinds in ``SECTIONED``."""
    return {kind: importlib.import_module(f"hpc.schedulers.{kind}.section") for kind in SECTIONED}


def section_class(common: type) -> type:
    """A site's ``[scheduler]`` section: a dataclass with ``common``'s fields (every kind's), then each
    kind's own ``Section`` fields in ``SECTIONED`` order. ``KIND_FIELDS`` on it says which kind declared
    which field (for the reference docs). Two kinds declaring one name is a programming error."""
    owners: dict[str, str] = {f.name: "" for f in dataclasses.fields(common)}
    kind_fields: dict[str, tuple[str, ...]] = {}
    sections = _sections()
    for kind, module in sections.items():
        names = tuple(f.name for f in dataclasses.fields(module.Section))
        clash = [name for name in names if name in owners]
        if clash:
            raise TypeError(f"hpc.schedulers.{kind}.section declares {clash}, already declared by "
                            f"{owners[clash[0]] or common.__qualname__}")
        owners.update(dict.fromkeys(names, kind))
        kind_fields[kind] = names
    # a dataclass collects fields from its bases last to first: common's come first
    bases = tuple(module.Section for module in reversed(sections.values())) + (common,)
    cls = dataclasses.make_dataclass(common.__name__.removeprefix("Common"), [], bases=bases)
    cls.__module__, cls.__doc__ = common.__module__, common.__doc__
    cls.KIND_FIELDS = kind_fields  # type: ignore[attr-defined]  # a class built here, its one extra attribute
    return cls


def cross_checked() -> tuple[str, ...]:
    """The ``[scheduler]`` fields the kinds' ``site_problems`` read."""
    return tuple(name for module in _sections().values() for name in getattr(module, "CROSS_CHECKED", ()))


def path_problem(value: str) -> str | None:
    """Why some kind would misread ``value`` as a folder for its logs (Slurm: ``%`` and ``\\`` in
    --output), or None. Checked whatever the site's kind, like ``LIMITS``: a run root that loads is one
    every scheduler takes."""
    for module in _sections().values():
        problem = getattr(module, "path_problem", lambda _: None)(value)
        if problem:
            return problem
    return None


def detect_site(name: str, saved: tp.Mapping[str, str | None]) -> str:
    """``hpcx site detect``: the draft profile (TOML) from the first kind in ``KINDS`` that can write
    one (``Scheduler.detect``); ``saved`` names saved tool outputs by option (``topo``, ``query`` …)."""
    for kind in KINDS:
        draft = get(kind).detect(name, saved)
        if draft is not None:
            return draft
    raise UserError(["hpcx site detect: no scheduler kind can draft a site profile"])


def _load(kind: str, index: int) -> tp.Any:
    module, *classes = KINDS[kind]
    return getattr(importlib.import_module(module), classes[index])


def _login_class(kind: str) -> type[Scheduler]:
    return _load(kind, 0)


def _job_class(kind: str) -> type[JobSide]:
    return _load(kind, 1)


def get(kind: str) -> Scheduler:
    """The login side of scheduler ``kind`` (one of ``KINDS``)."""
    return _login_class(kind)()


def job_side() -> JobSide | None:
    """The scheduler that started this task (each kind's ``JobSide.started_this_task``), else None."""
    for kind in KINDS:
        side = _job_class(kind)
        if side.started_this_task(os.environ):
            return side()
    return None


def rank_env(env: tp.Mapping[str, str]) -> RankEnv | None:
    """This task's rank, world and rank 0's address, when a scheduler started it itself (a task of a
    plain srun step, no submitit, no torchrun); None otherwise."""
    for kind in KINDS:
        found = _job_class(kind).rank_env(env)
        if found is not None:
            return found
    return None


def first_on_node(env: tp.Mapping[str, str]) -> bool:
    """Whether this task is its node's first (``JobSide.node_local_rank`` of the kind that says); True when
    no kind can tell (one task, or a plain process)."""
    for kind in KINDS:
        found = _job_class(kind).node_local_rank(env)
        if found is not None:
            return found == 0
    return True


def section_problems(section: tp.Any) -> list[str]:
    """Every kind's rules on the options it owns in a site's ``[scheduler]`` section (Slurm's sbatch
    table), on well-typed fields."""
    return [problem for kind in KINDS for problem in _login_class(kind).section_problems(section)]


def site_problems(site: SiteProfile) -> list[str]:
    """The site's own kind's cross-checks of a well-typed profile (Slurm's GPU directive on a GPU site)."""
    return get(site.scheduler.kind).site_problems(site)


def container_runtimes(kind: str) -> tp.Mapping[str, ContainerRuntime]:
    """The container runtimes a site of ``kind`` runs, by name (``Scheduler.container_runtimes``; empty: none)."""
    return get(kind).container_runtimes()


def container_runtime(name: str) -> ContainerRuntime | None:
    """The runtime ``name`` (a ``[container] runtime``) of the first kind that runs it; None when none does."""
    for kind in KINDS:
        found = container_runtimes(kind).get(name)
        if found is not None:
            return found
    return None
