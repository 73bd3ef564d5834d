"""Spec + site -> Launch: ``hpc.core.resolve``'s checks, then the planner's choice for `auto`. Pure.

The login side's one way to a launch (``hpcx render``, ``submit``, ``plan``'s cross-check, scaling
studies). The job never calls it: it reads the launch back from ``resolved.json``.
"""

from __future__ import annotations

from hpc.core.config import ConfigError
from hpc.core.resolve import Launch, cross_check, launch_for, script_launch
from hpc.core.site import SiteProfile
from hpc.core.spec import JobSpec
from hpc.core.tasks import sync_batchnorm_problems
from hpc.core.workload import ScriptWorkload


def resolve(spec: JobSpec, site: SiteProfile) -> Launch:
    """Check spec against site and compute the launch; raises ConfigError with every problem."""
    errors = cross_check(spec, site)
    if errors:
        raise ConfigError([f"{spec.source}: {e}" for e in errors])
    if isinstance(spec.workload, ScriptWorkload):  # the script decides its own layout: nothing to plan
        return script_launch(spec, site)
    from hpc.plan import choose  # the planner decides `auto`

    choice = choose(spec, site, spec.job.nodes)
    errors = sync_batchnorm_problems(spec, choice.dims.strategy)
    if errors:
        raise ConfigError([f"{spec.source}: {e}" for e in errors])
    return launch_for(spec, site, choice.dims, choice.cpu_offload, choice.reasons)
