"""Launch -> submitit parameters -> sbatch script text. Pure functions.

``render_sbatch`` returns byte for byte the script submitit writes for the
same parameters (it calls submitit's own ``_make_sbatch_string``, through hpc.compat), so
``hpcx render`` shows exactly what ``hpcx submit`` sends.
"""

from __future__ import annotations

import json
import shlex
import typing as tp

from hpc import compat
from hpc.resolve import Launch
from hpc.site import SiteProfile
from hpc.spec import JobSpec

SUBMITIT_DIR = "submitit"


def job_environment(spec: JobSpec, site: SiteProfile) -> dict[str, str]:
    """Variables exported in every task: the site's NCCL settings, then the spec's `env.set`."""
    env = dict(site.nccl)
    env.update(spec.env.set)
    return dict(sorted(env.items()))


def setup_lines(spec: JobSpec, site: SiteProfile) -> list[str]:
    """Shell lines run by the batch script before srun; every value is shell-quoted.

    The site's NCCL values are defaults (a value the user exported, e.g. NCCL_DEBUG, wins);
    the spec's ``env.set`` values are explicit for this job and always set.
    """
    lines = [f"[ -n \"${{{name}+x}}\" ] || export {name}={shlex.quote(value)}"
             for name, value in sorted(site.nccl.items()) if name not in spec.env.set]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(spec.env.set.items())]
    if spec.env.passthrough:
        names = " ".join(spec.env.passthrough)
        lines.insert(0, f"# passed by name from the submitting shell (values never written): {names}")
    return lines


def gpu_parameters(site: SiteProfile, launch: Launch) -> dict[str, tp.Any]:
    if not launch.gpus_per_node:
        return {}
    if site.scheduler.gpu_directive == "gres":
        return {"gres": f"gpu:{launch.gpus_per_node}"}
    return {"gpus_per_node": launch.gpus_per_node}


def slurm_parameters(spec: JobSpec, site: SiteProfile, launch: Launch) -> dict[str, tp.Any]:
    """Keyword arguments of submitit's SlurmExecutor for this launch."""
    params: dict[str, tp.Any] = {
        "job_name": spec.job.name,
        "nodes": launch.nodes,
        "ntasks_per_node": launch.tasks_per_node,
        "cpus_per_task": launch.cpus_per_task,
        "time": spec.job.time_limit_min,
        "signal_delay_s": launch.signal_lead_s,
        "stderr_to_stdout": False,
        "additional_parameters": {"requeue": True, **site.scheduler.sbatch},
    }
    for key in ("partition", "account", "qos"):
        if getattr(launch, key):
            params[key] = getattr(launch, key)
    params.update(gpu_parameters(site, launch))
    setup = setup_lines(spec, site)
    if setup:
        params["setup"] = setup
    return params


def local_parameters(spec: JobSpec, launch: Launch) -> dict[str, tp.Any]:
    """Keyword arguments of submitit's LocalExecutor for this launch."""
    return {
        "tasks_per_node": launch.tasks_per_node,
        "timeout_min": spec.job.time_limit_min,
        "signal_delay_s": launch.signal_lead_s,
    }


def submitit_command(python: str, folder: str) -> str:
    """The command submitit puts in the script (mirrors SlurmExecutor._submitit_command_str)."""
    return " ".join([python, "-u -m", compat.SUBMITIT_SUBMIT_MODULE, shlex.quote(folder)])


def render_sbatch(params: dict[str, tp.Any], python: str, folder: str) -> str:
    """The sbatch script submitit will write for these parameters."""
    return compat.make_sbatch_string(command=submitit_command(python, folder), folder=folder, **params)


def render_summary(spec: JobSpec, site: SiteProfile, launch: Launch) -> str:
    """Comment lines that explain the launch (printed to stderr by `hpcx render`)."""
    header = [
        f"# hpcx: {spec.job.name} on site {site.name!r} ({site.scheduler.kind})",
        f"# ranks: {launch.nodes} nodes × {launch.tasks_per_node} tasks = {launch.world_size} ({launch.backend})",
        f"# strategy: {launch.strategy}" + _strategy_detail(launch),
        f"# batch: global {spec.train.global_batch} = {launch.world_size} ranks × micro "
        f"{spec.train.micro_batch} × accumulation {launch.grad_accum}",
        f"# preemption: USR2 {launch.signal_lead_s} s before the time limit; requeued at most "
        f"{spec.job.max_requeues} times",
    ]
    header += [f"# plan: {reason}" for reason in launch.plan_reasons]
    return "\n".join(header) + "\n"


def render(spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str) -> str:
    """Exactly what is submitted: the sbatch script, or the local executor's parameters as JSON."""
    folder = f"{run_dir}/{SUBMITIT_DIR}"
    if site.is_slurm:
        body = render_sbatch(slurm_parameters(spec, site, launch), python, folder)
    else:
        params = {"executor": "local", "folder": folder, **local_parameters(spec, launch),
                  "environment": job_environment(spec, site), "command": submitit_command(python, folder)}
        body = json.dumps(params, indent=2, sort_keys=True) + "\n"
    return body


def _strategy_detail(launch: Launch) -> str:
    if launch.strategy == "fsdp":
        return f" ({launch.sharding}, sharded over {launch.shard} ranks)"
    if launch.strategy == "hsdp":
        return f" (mesh replicate={launch.replicate} × shard={launch.shard}, {launch.sharding})"
    return ""
