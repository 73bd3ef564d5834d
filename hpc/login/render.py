"""What ``hpcx render`` prints: the site's scheduler renders the submission (``hpc.schedulers``:
byte for byte what ``hpcx submit`` sends), and ``render_summary`` explains the launch. Pure.
"""

from __future__ import annotations

import json

from hpc import schedulers
from hpc.core.models import code_notice
from hpc.core.resolve import Launch
from hpc.core.site import SiteProfile
from hpc.core.spec import JobSpec
from hpc.core.tasks import code_notice as task_notice
from hpc.core.workload import ScriptWorkload


def layout_words(spec: JobSpec, launch: Launch) -> str:
    """The layout for people: the strategy with its numbers, or a script mode's command."""
    match spec.workload:
        case ScriptWorkload(command=command):
            return f"your command {json.dumps(command)} on every rank"
    return launch.dims.describe()


def render_summary(spec: JobSpec, site: SiteProfile, launch: Launch) -> str:
    """Comment lines that explain the launch (printed to stderr by `hpcx render`)."""
    if isinstance(spec.workload, ScriptWorkload):
        return script_summary(spec.workload, spec, site, launch)
    header = [
        f"# hpcx: {spec.job.name} on site {site.name!r} ({site.scheduler.kind})",
        f"# ranks: {launch.nodes} nodes × {launch.tasks_per_node} tasks = {launch.world_size} ({launch.backend})",
        f"# strategy: {launch.dims.describe()}" + ("; CPU offload" if launch.cpu_offload else ""),
        f"# batch: global {spec.train.global_batch} = {launch.world_size} ranks × micro "
        f"{spec.train.micro_batch} × accumulation {launch.grad_accum}",
        f"# preemption: USR2 {launch.signal_lead_s} s before the time limit; requeued at most "
        f"{spec.job.max_requeues} times",
    ]
    header += [f"# plan: {reason}" for reason in launch.plan_reasons]
    notice = user_code_notice(spec)
    if notice:
        header.append(f"# {notice}")
    return "\n".join(header) + "\n"


def script_summary(script: ScriptWorkload, spec: JobSpec, site: SiteProfile, launch: Launch) -> str:
    """``render_summary`` of a script-mode spec: where and how the command runs, and its preemption."""
    lines = [
        f"# hpcx: {spec.job.name} on site {site.name!r} ({site.scheduler.kind})",
        f"# ranks: {launch.nodes} nodes × {launch.tasks_per_node} tasks = {launch.world_size} ({launch.backend})",
        f"# command: {json.dumps(script.command)} on every rank, in the folder `hpcx submit` runs in, with "
        "torchrun's RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT",
        f"# preemption: USR2 {launch.signal_lead_s} s before the time limit, forwarded to the command and flagged "
        f"for hpc.job.preempted(); requeued when it asks (hpc.job.requeue()), at most {spec.job.max_requeues} times",
    ]
    return "\n".join(lines) + "\n"


def user_code_notice(spec: JobSpec) -> str | None:
    """What the model means for the tasks, from its family (a `module:function` model: that code is
    imported and called in every task); None for the built-in families."""
    return task_notice(spec) or code_notice(spec.model)


def render(spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str) -> str:
    """Exactly what is submitted: the sbatch script, or the local executor's parameters as JSON."""
    return schedulers.get(site.scheduler.kind).render(spec, site, launch, run_dir, python)
