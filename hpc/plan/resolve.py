"""Spec + site -> Launch: ``hpc.core.resolve``'s checks, then the planner's choice for `auto`. Pure.

The login side's one way to a launch (``hpcx render``, ``submit``, ``plan``'s cross-check, scaling
studies). The job never calls it: it reads the launch back from ``resolved.json``.
"""

from __future__ import annotations

import dataclasses
import typing as tp

from hpc.core import preflight
from hpc.core.config import ConfigError
from hpc.core.resolve import Launch, cross_check, launch_for, script_launch
from hpc.core.site import SiteProfile
from hpc.core.spec import JobSpec
from hpc.core.tasks import sync_batchnorm_problems
from hpc.core.workload import ScriptWorkload
from hpc.plan import choose


def resolve(spec: JobSpec, site: SiteProfile) -> Launch:
    """Check spec against site and compute the launch; raises ConfigError with every problem."""
    errors = cross_check(spec, site)
    if errors:
        raise ConfigError([f"{spec.source}: {e}" for e in errors])
    if isinstance(spec.workload, ScriptWorkload):  # the script decides its own layout: nothing to plan
        return script_launch(spec, site)
    choice = choose(spec, site, spec.job.nodes)  # the planner decides `auto`
    errors = sync_batchnorm_problems(spec, choice.dims.strategy)
    if errors:
        raise ConfigError([f"{spec.source}: {e}" for e in errors])
    launch = launch_for(spec, site, choice.dims, choice.cpu_offload, choice.reasons)
    if not (site.node.gpus and spec.health.preflight):
        return launch
    busbw = preflight_busbw(site, launch.world_size, launch.tasks_per_node, preflight.NBYTES)
    return dataclasses.replace(launch, preflight_busbw_gbs=round(busbw, 1) if busbw else None)


def preflight_busbw(site: tp.Any, world: int, per_node: int, nbytes: int) -> float:
    """The bus bandwidth NCCL's tuning model (``hpc.plan.collectives``, the planner's) gives an all-reduce of
    ``nbytes`` over ``world`` ranks, ``per_node`` a node, on ``site``; 0 when it cannot tell."""
    from hpc.plan.collectives import best, bus_factor  # lazy: startup
    from hpc.plan.comm import Group, group_topology  # lazy: startup

    found = best("all_reduce", nbytes, group_topology(Group(world, per_node), site, per_node))
    return nbytes / found.seconds / 1e9 * bus_factor("all_reduce", world) if found else 0.0
