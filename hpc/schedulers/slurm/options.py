"""A site's extra sbatch options (``[scheduler.sbatch]``): which names it may give, and how their values
survive sbatch's directive parser. Checked when a site loads (``SlurmScheduler.section_problems``);
``directive_value`` prepares a value for its ``#SBATCH`` line. Torch-free.
"""

from __future__ import annotations

import re
import typing as tp
import unicodedata

from hpc.core.validate import INT32_MAX, secret_value_kind, shown

SBATCH_KEY = re.compile(r"[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*\Z")
# Every long option of sbatch (Slurm 22.05: `sbatch --X=1 --version` for each letter X lists the options
# that start with X; a few newer ones too). getopt_long reads a unique prefix of one as that option.
SBATCH_OPTIONS = frozenset("""
account acctg-freq array batch bb bbf begin chdir cluster cluster-constraint clusters comment constraint
container context contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot
dependency distribution error exclude exclusive export export-file extra-node-info get-user-env gid gpu-bind
gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags help hint hold ignore-pbs input
job-name kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mincpus
network nice no-kill no-requeue nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu ntasks-per-node
ntasks-per-socket ntasks-per-tres open-mode output overcommit oversubscribe parsable partition power prefer
priority profile propagate qos quiet reboot requeue reservation signal sockets-per-node spread-job switches
tasks-per-node test-only thread-spec threads-per-core time time-min tmp uid usage use-min-nodes verbose version
wait wait-all-nodes wckey wrap tres-per-task
""".split())
# Options hpcx renders itself (the spec or site field to use instead). Any other option on hpcx's own
# #SBATCH lines (``owned`` of ``check_sbatch``, read off a rendered script) is refused as well.
SBATCH_OWNED = {
    "job-name": "`job.name`", "nodes": "`job.nodes`", "ntasks": "`job.nodes` × `job.tasks_per_node`",
    "ntasks-per-node": "`job.tasks_per_node`", "tasks-per-node": "`job.tasks_per_node`",
    "ntasks-per-gpu": "`job.tasks_per_node`",
    "cpus-per-task": "`job.cpus_per_task`", "time": "`job.time_limit_min`",
    "signal": "`scheduler.signal_lead_s` or `job.signal_lead_s`", "requeue": "`job.max_requeues`",
    "no-requeue": "`job.max_requeues`", "partition": "`scheduler.partition` or `job.partition`",
    "account": "`scheduler.account` or `job.account`", "qos": "`scheduler.qos` or `job.qos`",
    "gpus": "`node.gpus` with `scheduler.gpu_directive`", "gpus-per-node": "`node.gpus` with `scheduler.gpu_directive`",
    "gres": "`node.gpus` with `scheduler.gpu_directive` = 'gres'",
}
# Options refused for what they do, by effect.
_LOGS, _ENV, _USER, _ONE = ("hpcx writes each rank's log into the run folder",
                            "the job must see the submitting shell (env.passthrough)",
                            "the job runs as the submitting user", "an hpcx job is one job")
_MOVES = "it sends the job to another cluster, where `hpcx status`, `cancel` and the requeue check cannot see it"
_COUNT = ("it adds a second {what} count beside the ones hpcx sets (`job.tasks_per_node`, `job.cpus_per_task`, "
          "`node.gpus`): Slurm would refuse the pair or lay the job out differently from the plan")
_NOTHING = "with it sbatch submits nothing (or not the job)"
SBATCH_REFUSED = {
    "output": _LOGS, "error": _LOGS, "open-mode": "hpcx appends to the logs across requeues",
    "input": "a batch job reads no terminal", "export": _ENV, "export-file": _ENV, "get-user-env": _ENV,
    "chdir": "the job runs in the submitting folder, from where `model.arch` modules are imported",
    "uid": _USER, "gid": _USER, "clusters": _MOVES, "cluster": _MOVES, "cluster-constraint": _MOVES,
    "array": _ONE, "hetjob": _ONE, "packjob": _ONE, "wrap": "hpcx provides the script",
    "gpus-per-task": _COUNT.format(what="GPU"), "gpus-per-socket": _COUNT.format(what="GPU"),
    "tres-per-task": _COUNT.format(what="GPU"), "cpus-per-gpu": _COUNT.format(what="CPU"),
    "mem-per-gpu": _COUNT.format(what="memory (per GPU)"), "ntasks-per-core": _COUNT.format(what="task"),
    "ntasks-per-socket": _COUNT.format(what="task"), "ntasks-per-tres": _COUNT.format(what="task"),
    "distribution": "hpcx lays its ranks out node by node (the HSDP shard group is one node)",
    "parsable": "submitit reads the job id from sbatch's own output line",
    "quiet": "submitit reads the job id from sbatch's own output line, which --quiet suppresses",
    "test-only": _NOTHING, "version": _NOTHING, "help": _NOTHING, "usage": _NOTHING,
    "wait": "sbatch would block until the job ends",
}
# Options Slurm takes only one of: `--mem`, `--mem-per-cpu` and `--mem-per-gpu` are mutually exclusive.
SBATCH_EXCLUSIVE = (("mem", "mem-per-cpu"), ("mem", "mem-per-gpu"), ("mem-per-cpu", "mem-per-gpu"),
                    ("exclusive", "oversubscribe"))


def sbatch_option(key: str) -> str:
    """The option name sbatch sees (submitit writes ``_`` as ``-``)."""
    return key.replace("_", "-")


def sbatch_reads_as(option: str) -> list[str]:
    """The options sbatch's getopt_long may take ``--option`` for: itself when it is one, else every
    option it is a prefix of (one: read as that one; several: sbatch refuses it as ambiguous)."""
    if option in SBATCH_OPTIONS:
        return [option]
    return sorted(o for o in SBATCH_OPTIONS if o.startswith(option))


def check_sbatch_key(path: str, key: str, owned: tp.Collection[str] = ()) -> list[str]:
    """An option name sbatch reads as itself, judged by what it does: not one hpcx sets (``SBATCH_OWNED``
    and ``owned``, the options on hpcx's own #SBATCH lines), not one ``SBATCH_REFUSED`` names, not an
    abbreviation."""
    if not SBATCH_KEY.match(key):
        other = next((ch for ch in key if not ch.isascii() and ch.isprintable()), None)
        what = f" (`{other}` is U+{ord(other):04X} {unicodedata.name(other, '')}".rstrip() + ")" if other else ""
        return [f"`{path}`: option name {shown(key)!r}{what}: expected an sbatch long option name without the "
                "dashes (lower-case letters, digits and `-`), e.g. constraint or mem-per-cpu"]
    option = sbatch_option(key)
    if option in SBATCH_OWNED:
        return [f"`{path}`: --{option} is set by hpcx from {SBATCH_OWNED[option]}: set that instead"]
    if option in SBATCH_REFUSED:
        return [f"`{path}`: --{option} cannot be given here: {SBATCH_REFUSED[option]}"]
    if option in owned:
        return [f"`{path}`: --{option} is already on hpcx's own #SBATCH lines: a second one would replace it"]
    return _abbreviation(path, option, owned)


def _abbreviation(path: str, option: str, owned: tp.Collection[str]) -> list[str]:
    """getopt_long takes an unambiguous prefix as the whole option: refuse every one."""
    if option in SBATCH_OPTIONS:  # an option of its own (mem), whatever it is a prefix of (mem-per-cpu)
        return []
    known = {*SBATCH_OWNED, *SBATCH_REFUSED, *owned}
    shadowed = sorted(o for o in known if o.startswith(option))
    if shadowed:
        return [f"`{path}`: --{option} is an abbreviation sbatch may read as "
                + " or ".join(f"--{o}" for o in shadowed) + ": expected a full option name"]
    reads = sbatch_reads_as(option)
    if reads and reads != [option]:
        what = f"of --{reads[0]}" if len(reads) == 1 else "sbatch refuses as ambiguous (" + \
            ", ".join(f"--{o}" for o in reads) + ")"
        return [f"`{path}`: --{option} is an abbreviation {what}: expected a full option name"]
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


def check_sbatch(table: dict[str, tp.Any], owned: tp.Collection[str] = ()) -> list[str]:
    """Every problem with a site's [scheduler.sbatch] table: each name (also beside a value of the wrong
    type, which the loader reports), each value, a name given twice and options Slurm takes only one of.
    ``owned``: the options on hpcx's own #SBATCH lines."""
    errors: list[str] = []
    seen: dict[str, str] = {}
    for key, value in table.items():
        path = f"scheduler.sbatch.{shown(key)}"
        errors += check_sbatch_key(path, key, owned)
        if isinstance(value, str):  # numbers and other types: the loader checks them
            errors += check_sbatch_value(path, value)
        option = sbatch_option(key)
        if option in seen:
            errors.append(f"`{path}`: --{option} is also given as `{seen[option]}`: expected it once")
        if value is not False:  # `false` leaves the option out
            seen.setdefault(option, key)
    return errors + _exclusive_options(seen)


def _exclusive_options(seen: dict[str, str]) -> list[str]:
    return [f"`scheduler.sbatch.{shown(seen[a])}` and `scheduler.sbatch.{shown(seen[b])}`: sbatch takes only one "
            f"of --{a} and --{b}: expected one" for a, b in SBATCH_EXCLUSIVE if a in seen and b in seen]


def directive_value(value: str) -> str:
    """``value`` prepared for an ``#SBATCH --opt=VALUE`` line that submitit quotes with shlex.quote.

    sbatch's directive parser takes quotes as the shell does, but reads a backslash as an escape even
    inside single quotes (a job named ``a\\b`` became ``ab``). shlex.quote puts any value holding a
    backslash in single quotes, so doubling each backslash makes the parser give back ``value``
    byte for byte; every other character survives shlex.quote as it is (tried on Slurm 22.05).
    """
    return value.replace("\\", "\\\\")
