"""A site's extra sbatch options (``[scheduler.sbatch]``): which names it may give, and how their values
survive sbatch's directive parser. Checked when a site loads (``SlurmScheduler.section_problems``);
``directive_value`` prepares a value for its ``#SBATCH`` line. Torch-free.
"""

from __future__ import annotations

import re
import typing as tp

from hpc.core.validate import INT32_MAX, secret_value_kind, shown

SBATCH_KEY = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*\Z")
# Options hpcx renders itself (the spec or site field to use instead), and options that would change
# how its script works: where the logs go, which environment the job sees, who runs it, or that turn
# the submission into something else (an array, a wrapped command, a test).
SBATCH_OWNED = {
    "job-name": "`job.name`", "nodes": "`job.nodes`", "ntasks": "`job.nodes` × `job.tasks_per_node`",
    "ntasks-per-node": "`job.tasks_per_node`", "ntasks-per-gpu": "`job.tasks_per_node`",
    "cpus-per-task": "`job.cpus_per_task`", "time": "`job.time_limit_min`",
    "signal": "`scheduler.signal_lead_s` or `job.signal_lead_s`", "requeue": "`job.max_requeues`",
    "no-requeue": "`job.max_requeues`", "partition": "`scheduler.partition` or `job.partition`",
    "account": "`scheduler.account` or `job.account`", "qos": "`scheduler.qos` or `job.qos`",
    "gpus": "`node.gpus` with `scheduler.gpu_directive`", "gpus-per-node": "`node.gpus` with `scheduler.gpu_directive`",
    "gres": "`node.gpus` with `scheduler.gpu_directive` = 'gres'",
}
_LOGS, _ENV, _USER, _ONE = ("hpcx writes each rank's log into the run folder",
                            "the job must see the submitting shell (env.passthrough)",
                            "the job runs as the submitting user", "an hpcx job is one job")
SBATCH_REFUSED = {
    "output": _LOGS, "error": _LOGS, "open-mode": "hpcx appends to the logs across requeues",
    "input": "a batch job reads no terminal", "export": _ENV, "export-file": _ENV, "uid": _USER, "gid": _USER,
    "array": _ONE, "hetjob": _ONE, "packjob": _ONE, "wrap": "hpcx provides the script",
    "parsable": "not an option of the job", "test-only": "not an option of the job", "wait": "not an option of the job",
}


def sbatch_option(key: str) -> str:
    """The option name sbatch sees (submitit writes ``_`` as ``-``)."""
    return key.replace("_", "-")


def check_sbatch_key(path: str, key: str) -> list[str]:
    """An option name sbatch reads as itself: its shape, not one hpcx owns, not an abbreviation of one."""
    if not SBATCH_KEY.match(key):
        return [f"`{path}`: option name {shown(key)!r}: expected an sbatch long option name without the "
                "dashes (lower-case letters, digits and `-`), e.g. constraint or mem-per-cpu"]
    option = sbatch_option(key)
    if option in SBATCH_OWNED:
        return [f"`{path}`: --{option} is set by hpcx from {SBATCH_OWNED[option]}: set that instead"]
    if option in SBATCH_REFUSED:
        return [f"`{path}`: --{option} cannot be given here: {SBATCH_REFUSED[option]}"]
    shadowed = sorted(o for o in (*SBATCH_OWNED, *SBATCH_REFUSED) if o.startswith(option))
    if shadowed:  # getopt_long takes an unambiguous prefix as the whole option
        return [f"`{path}`: --{option} is an abbreviation sbatch may read as "
                + " or ".join(f"--{o}" for o in shadowed) + ": expected a full option name"]
    return []


def check_sbatch_value(path: str, value: tp.Any) -> list[str]:
    """A directive value: a string that survives the directive parser, an integer, or true/false."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        if abs(value) > INT32_MAX:
            return [f"`{path}` = {value}: expected an integer within ±{INT32_MAX}"]
        return []
    if value == "":
        return [f"`{path}` = '': expected a value (write `true` for an option that takes none)"]
    if kind := secret_value_kind(value):
        return [f"`{path}` holds what looks like {kind}: #SBATCH lines are written into the run folder"]
    return []


def check_sbatch(table: dict[str, tp.Any]) -> list[str]:
    """Every problem with a site's [scheduler.sbatch] table (types and text are checked by the loader)."""
    errors, seen = [], {}
    for key, value in table.items():
        path = f"scheduler.sbatch.{shown(key)}"
        errors += check_sbatch_key(path, key) or check_sbatch_value(path, value)
        option = sbatch_option(key)
        if option in seen:
            errors.append(f"`{path}`: --{option} is also given as `{seen[option]}`: expected it once")
        seen[option] = key
    return errors


def directive_value(value: str) -> str:
    """``value`` prepared for an ``#SBATCH --opt=VALUE`` line that submitit quotes with shlex.quote.

    sbatch's directive parser takes quotes as the shell does, but reads a backslash as an escape even
    inside single quotes (a job named ``a\\b`` became ``ab``). shlex.quote puts any value holding a
    backslash in single quotes, so doubling each backslash makes the parser give back ``value``
    byte for byte; every other character survives shlex.quote as it is (tried on Slurm 22.05).
    """
    return value.replace("\\", "\\\\")
