"""What a site's ``[scheduler]`` section holds for Slurm, and what Slurm demands of paths. Torch-free.

``Section`` declares the fields only a Slurm site uses (its default partition, account and QOS, how it
takes GPUs, the extra sbatch options); ``hpc.schedulers.section_class`` joins them with the fields every
kind has (``hpc.core.site.CommonScheduler``) into the section a profile loads. Their rules live beside
them: ``SlurmScheduler.section_problems`` (the sbatch table, ``options``) and ``site_problems`` (the GPU
directive). ``path_problem`` is why Slurm would misread a folder in ``--output``/``--error``.
"""

from __future__ import annotations

import typing as tp
from dataclasses import dataclass

from hpc.core.config import field

# the section's fields the kind's cross-checks of a site read (``SlurmScheduler.site_problems``)
CROSS_CHECKED = ("scheduler.gpu_directive",)


@dataclass
class Section:
    partition: str | None = field(None, doc="Default Slurm partition (`--partition`); a spec may override.")
    account: str | None = field(None, doc="Default Slurm account (`--account`).")
    qos: str | None = field(None, doc="Default Slurm QOS (`--qos`).")
    gpu_directive: str = field("gpus-per-node", doc="How this Slurm takes GPUs: `gpus-per-node` "
                               "(`--gpus-per-node=N`), `gres` (`--gres=gpu:N`), or `none` on CPU clusters.",
                               choices=("gpus-per-node", "gres", "none"))
    sbatch: dict[str, str | int | bool] = field(
        doc="Extra sbatch options for every job, e.g. {constraint = \"h100\", exclusive = true}: long option "
        "names without the dashes; a string or integer value, `true` for an option without a value, `false` "
        "to leave it out. Judged by what they do: options on hpcx's own #SBATCH lines (job-name, nodes, "
        "ntasks-per-node, cpus-per-task, time, signal, requeue, partition, account, qos, gpus-per-node, gres, "
        "wckey …), options that move the job to another cluster (clusters), change its logs, environment, "
        "folder or user (output, error, open-mode, export, get-user-env, chdir, uid …), add a second GPU, "
        "CPU, task or memory count (gpus-per-task, cpus-per-gpu, mem-per-gpu, ntasks-per-core …), make "
        "sbatch submit nothing (version, help, usage, test-only) and every abbreviation are refused, as are "
        "options Slurm takes only one of (mem with mem-per-cpu). Values reach the `#SBATCH` line exactly "
        "(sbatch's reading of quotes and backslashes is accounted for).", factory=dict)


def overcommits(section: tp.Any) -> bool:
    """Whether the site's sbatch options ask for ``--overcommit`` (then tasks share CPUs)."""
    return any(k.replace("_", "-") == "overcommit" and x is not False for k, x in section.sbatch.items())


def path_problem(value: str) -> str | None:
    """Why Slurm would not write its log files where hpcx looks for them, or None."""
    if "%" in value:
        return ("expected a path without `%`: Slurm reads %u, %j … in --output/--error as file-name "
                "patterns (use $USER and friends, which hpcx expands)")
    if "\\" in value:
        return "expected a path without `\\`: Slurm then stops expanding the log file names"
    return None
