"""Slurm: sbatch parameters and script, sacct/squeue/scontrol, scancel, and the job side's requeue.

``render`` returns byte for byte the script submitit writes for the same parameters (it calls
submitit's own script builder, through ``hpc.compat``), so ``hpcx render`` shows exactly what
``hpcx submit`` sends. Commands run as argument lists (never through a shell) with a timeout.

The script fails the way a cluster needs: ``srun --kill-on-bad-exit=1`` ends every task as soon as
one fails (instead of leaving the others blocked in a collective until its timeout), and the check
after srun (``python -m hpc.requeue``) then decides the one requeue, whichever rank died and however
(see ``hpc.core.requeue``). The batch shell and each task ignore USR2 until the trainer's handler takes it.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import sys
import threading
import time
import typing as tp
from pathlib import Path
from types import SimpleNamespace as Ns

from hpc.compat import make_sbatch_string
from hpc.core.container import image_source, job_reads, submit_problems
from hpc.core.errors import UserError
from hpc.schedulers.base import (PLACEMENT, Placement, QUERY_TIMEOUT_S, SUBMITIT_DIR, UNREACHABLE, ContainerRuntime,
                                 JobSide, JobState, RankEnv, Scheduler, Step, batch_log, run_on, task_argv, try_command, unknown,
                                 wait_since_last_stop)
from hpc.schedulers.slurm import container as sc, ranks
from hpc.schedulers.slurm.container import RUNTIMES, prepare_run, request_host_requeue
from hpc.schedulers.slurm.options import check_sbatch, directive_value
from hpc.schedulers.slurm.section import overcommits

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.resolve import Launch
    from hpc.core.site import SiteProfile
    from hpc.core.spec import JobSpec


def _log() -> tp.Any:
    """The trainer's logger (the job side logs; `hpcx status` does not import logging for it)."""
    import logging  # lazy: startup

    return logging.getLogger("hpcx.trainer")


REQUEUE_ATTEMPTS = 3
REQUEUED_STATES = ("REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "PENDING", "CONFIGURING")
CHECK_ENV = "HPCX_REQUEUE_CHECK"  # exported by the script: the check after srun decides failure requeues
SRUN_ARGS = ["--kill-on-bad-exit=1"]


# ---------------------------------------------------------------- parameters and script (pure)


def setup_lines(spec: JobSpec, site: SiteProfile) -> list[str]:
    """Shell lines run by the batch script before srun; every value is shell-quoted.

    First the USR2 trap (a USR2 sent to the batch shell, e.g. ``scancel --full --signal=USR2``, would
    end it and with it the job; srun still forwards the signals it gets to the tasks) and the note that
    the check after srun decides failure requeues. The site's NCCL values are defaults (a value the
    user exported, e.g. NCCL_DEBUG, wins); the spec's ``env.set`` values are explicit for this job and
    always set.
    """
    lines = ["trap '' USR2  # the batch shell outlives a USR2; each task holds it until the trainer's handler "
             "takes it (srun line)",
             f"export {CHECK_ENV}=after-srun  # a failed srun is requeued (once) by the check after it",
             f'echo "{START_MARK} ${{SLURM_JOB_ID}}.${{SLURM_RESTART_COUNT:-0}}" >&2  # where srun\'s account of '
             "this start begins in the batch log"]
    lines += [f"[ -n \"${{{name}+x}}\" ] || export {name}={shlex.quote(value)}"
              for name, value in sorted(site.nccl.items()) if name not in spec.env.set]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(spec.env.set.items())]
    if spec.env.passthrough:
        names = " ".join(spec.env.passthrough)
        lines.insert(0, f"# passed by name from the submitting shell (values never written): {names}")
    return lines


def teardown_lines(run_dir: str, python: str) -> list[str]:
    """After srun: its status is the job's; a failure goes to the requeue check (``hpc.core.requeue``)."""
    from hpc.core.imports import python_command  # lazy: startup

    check = shlex.join(python_command(python, "hpc.requeue", run_dir))  # python -m hpc.requeue RUN_DIR
    return ["hpcx_srun_status=$?  # srun ends as soon as any task fails (--kill-on-bad-exit=1)",
            f'[ "$hpcx_srun_status" -eq 0 ] || {check} "$hpcx_srun_status"',
            'exit "$hpcx_srun_status"', ""]  # "": the script ends with a newline


def gpu_parameters(site: SiteProfile, launch: Launch) -> dict[str, tp.Any]:
    if not launch.gpus_per_node:
        return {}
    if site.scheduler.gpu_directive == "gres":
        return {"gres": f"gpu:{launch.gpus_per_node}"}
    return {"gpus_per_node": launch.gpus_per_node}


def sbatch_extras(table: dict[str, tp.Any]) -> dict[str, tp.Any]:
    """A site's [scheduler.sbatch] as submitit's additional_parameters: `true` is a bare flag, `false`
    leaves the option out, strings are prepared for sbatch's directive parser."""
    return {key: directive_value(value) if isinstance(value, str) else value
            for key, value in table.items() if value is not False}


def slurm_parameters(spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str,
                     step: Step | None = None) -> dict[str, tp.Any]:
    """Keyword arguments of submitit's SlurmExecutor for this launch, the step's lines and flags taken from
    ``step`` (default: the plain step without a container, ``run_dir`` and ``python`` for the check after
    srun); every string that lands on an ``#SBATCH`` line goes through ``directive_value`` so that sbatch
    reads back exactly the value."""
    step = step or plain_step(spec, site, run_dir, python)
    params: dict[str, tp.Any] = {
        "job_name": directive_value(spec.job.name),
        "nodes": launch.nodes,
        "ntasks_per_node": launch.tasks_per_node,
        "cpus_per_task": launch.cpus_per_task,
        "time": spec.job.time_limit_min,
        "signal_delay_s": launch.signal_lead_s,
        "stderr_to_stdout": False,
        "srun_args": [*SRUN_ARGS, *step.srun_args],
        "additional_parameters": {"requeue": True, **sbatch_extras(site.scheduler.sbatch)},
    }
    for key in PLACEMENT:
        if getattr(launch, key):
            params[key] = directive_value(getattr(launch, key))
    params.update(gpu_parameters(site, launch))
    params["setup"] = list(step.setup)
    params["teardown"] = list(step.teardown)
    return params


def render_sbatch(params: dict[str, tp.Any], step: Step, folder: str) -> str:
    """The sbatch script submitit writes for these parameters and the step's command."""
    return make_sbatch_string(command=step.command, folder=folder, **params)


def plain_step(spec: JobSpec, site: SiteProfile, run_dir: str, python: str) -> Step:
    """The step without a container: ``task_command``, the job's environment before it, the check after it."""
    argv = task_argv(python, f"{run_dir}/{SUBMITIT_DIR}")
    return Step(tuple(argv), tuple(setup_lines(spec, site)), tuple(teardown_lines(run_dir, python)))


def slurm_step(spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str, workdir: str) -> Step:
    """The submission's step: ``plain_step``, or with a ``[container]`` its runtime's (``hpc.schedulers.slurm.
    container``): the command in the image, its flags, setup lines and mounts (``spec``'s input folders
    read-only), and after srun the requeue rank 0 asked for from inside."""
    plain = plain_step(spec, site, run_dir, python)
    if not site.container.enabled:
        return plain
    links = sc.overlay_links()
    wrapped, mounts = sc.trainer_step(site.container, run_dir, f"{run_dir}/{SUBMITIT_DIR}", workdir,
                                      bool(launch.gpus_per_node), links, job_reads(spec))
    teardown = plain.teardown  # the requeue asked for inside goes right after the line that keeps srun's status
    return Step(wrapped.argv, (*plain.setup, *wrapped.setup),
                (teardown[0], sc.host_requeue_line(run_dir), *teardown[1:]), wrapped.srun_args, tuple(mounts),
                tuple(sorted(links.items())), container=True)


def prepare_container(spec: JobSpec, site: SiteProfile, run_dir: Path, step: Step) -> None:
    """At submit: the image is there (UserError naming the file that named it: the spec's [container] or the
    site's), then the step's overlay and what its runtime needs on the nodes (``container.prepare_run``)."""
    source = image_source(spec, site)
    found = submit_problems(site.container, source)
    if found:
        raise UserError(found)
    prepare_run(site.container, run_dir, os.getcwd(), gpus=site.node.gpus, where=f"{source}: `container.image`",
                source=site.source, links=dict(step.links), mounts=step.mounts)


@functools.cache
def owned_options() -> frozenset[str]:
    """Every option on hpcx's own ``#SBATCH`` lines, read off scripts rendered for each way a site takes
    GPUs with every optional field set: what a site's [scheduler.sbatch] may not give a second time."""
    spec = Ns(job=Ns(name="j", time_limit_min=1), env=Ns(set={}, passthrough=[]))
    launch = Ns(nodes=1, tasks_per_node=1, cpus_per_task=1, signal_lead_s=1, gpus_per_node=1,
                partition="p", account="a", qos="q")
    found: set[str] = set()
    for directive in ("gpus-per-node", "gres"):
        site = Ns(scheduler=Ns(sbatch={}, gpu_directive=directive), nccl={})
        step = plain_step(spec, site, "/run", "python")  # type: ignore[arg-type]
        params = slurm_parameters(spec, site, launch, "/run", "python", step)  # type: ignore[arg-type]
        found |= set(re.findall(r"^#SBATCH --([a-z0-9-]+)", render_sbatch(params, step, "/run/s"), re.M))
    return frozenset(found)


# ---------------------------------------------------------------- srun's account of a failed step (pure)

# The batch shell writes this line to its stderr at each start (setup_lines), so that the check after
# srun reads only what srun said in this start (the batch log is appended to across requeues).
START_MARK = "hpcx: start of job"
BATCH_LOG_TAIL = 4 << 20  # bytes read from the batch log's end (task 0's tracebacks share the file)
SRUN_TASK = re.compile(r"^srun: error: (?P<host>[^:\s]+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+?)\s*$")
SRUN_ENDS_STEP = re.compile(r"^srun: .*Terminating (StepId|job step)|^slurmstepd\S*: error: \*\*\* STEP .* CANCELLED")


def start_mark(job_id: str, restart: int) -> str:
    """The line that opens the batch log's part for one start (``JOB.RESTART``)."""
    return f"{START_MARK} {job_id}.{restart}"


def this_start(text: str, job_id: str, restart: int) -> str:
    """The part of the batch log between this start's mark and the next start's (all of it when there
    is no mark: a script of an older hpcx)."""
    mark = start_mark(job_id, restart)
    lines = text.splitlines()
    opened = [i for i, line in enumerate(lines) if line.strip() == mark]
    if not opened:
        return "\n".join(lines)
    part = lines[opened[-1] + 1:]
    end = next((i for i, line in enumerate(part) if line.startswith(START_MARK)), len(part))
    return "\n".join(part[:end])


def srun_task_ends(text: str) -> list[dict[str, tp.Any]]:
    """srun's lines about tasks that ended badly, in order: ranks, host, what srun said, the signal
    (``SIGKILL`` for "Killed") or the exit code, and ``first``: said before srun began to end the step
    (the tasks that failed on their own; the rest were ended by srun, or failed for their peer)."""
    ends, first = [], True
    for line in text.splitlines():
        if SRUN_ENDS_STEP.search(line):
            first = False
            continue
        match = SRUN_TASK.match(line)
        if match is None:
            continue
        what = match.group("what")
        ends.append({"ranks": task_ranks(match.group("tasks")), "host": match.group("host"), "what": what,
                     **task_end(what), "first": first})
    return ends


def task_ranks(text: str) -> list[int]:
    """``0,2-3`` → [0, 2, 3]."""
    ranks: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if low.isdigit() and (high.isdigit() or not high):
            ranks += range(int(low), int(high or low) + 1)
    return ranks


def task_end(what: str) -> dict[str, tp.Any]:
    """{"signal": "SIGKILL"} for srun's "Killed" (strsignal's words), {"exit_code": N} for "Exited with
    exit code N", {} otherwise."""
    code = re.fullmatch(r"Exited with exit code (\d+)", what)
    if code:
        return {"exit_code": int(code.group(1))}
    words = what.removesuffix(" (core dumped)")
    for sig in signal.Signals:
        if signal.strsignal(sig) == words:
            return {"signal": sig.name}
    return {}


# ---------------------------------------------------------------- scontrol output


def parse_scontrol(text: str) -> dict[str, str]:
    """One record of ``scontrol -o show job|node`` as a dict (values without spaces are enough here)."""
    return dict(tok.split("=", 1) for tok in text.split() if "=" in tok)


def scontrol_seconds(stamp: str) -> float | None:
    """``2026-11-29T18:37:30`` (the controller's local time) as epoch seconds; None for Unknown/None."""
    import datetime  # lazy: startup (status, which asks only sacct/squeue, never needs it)

    try:
        return datetime.datetime.fromisoformat(stamp).timestamp()
    except (TypeError, ValueError):
        return None


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol -o show job JOB`` as a dict; empty when it fails."""
    ok, out = try_command(["scontrol", "-o", "show", "job", job_id])
    return parse_scontrol(out) if ok else {}


# ---------------------------------------------------------------- state queries

# Whether the controller listens, asked before squeue/scontrol: with slurmctld down they retry for
# MessageTimeout and more (18 s measured on the sandbox); a TCP connect says it in milliseconds.
PROBE_S = 0.5
SLURM_CONFS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf", "/usr/local/etc/slurm.conf",
               "/run/slurm/conf/slurm.conf")


def _sacct(ids: list[str], timeout: float) -> tuple[dict[str, JobState] | None, str]:
    ok, out = try_command(["sacct", "-j", ",".join(ids), "-X", "-n", "-P",
                           "--format=JobID,State,NodeList,ExitCode"], timeout)
    if not ok:
        return None, out
    found: dict[str, JobState] = {}
    for line in out.strip().splitlines():  # with requeues an id repeats; its last line is current
        fields = line.split("|")
        job = fields[0].split("_")[0].split(".")[0]
        state = fields[1].split()[0] if len(fields) > 1 and fields[1] else "UNKNOWN"
        found[job] = JobState(state, fields[2] if len(fields) > 2 else "", "sacct",
                              {"exit_code": fields[3] if len(fields) > 3 else ""})
    return found, ""


def _squeue(ids: list[str], timeout: float) -> tuple[dict[str, JobState] | None, str]:
    ok, out = try_command(["squeue", "-h", "-j", ",".join(ids), "-o", "%i|%T|%N"], timeout)
    if not ok:
        return None, out
    found = {}
    for line in out.strip().splitlines():
        job, state, nodes = (line.split("|") + ["", ""])[:3]
        found[job] = JobState(state, nodes, "squeue")
    return found, ""


def _scontrol(ids: list[str], timeout: float) -> tuple[dict[str, JobState] | None, str]:
    """One ``scontrol -o show job`` (every job the controller still remembers), filtered to ``ids``."""
    ok, out = try_command(["scontrol", "-o", "show", "job"], timeout)
    if not ok:
        return None, out
    found, wanted = {}, set(ids)
    for line in out.splitlines():
        fields = parse_scontrol(line)
        if fields.get("JobId") in wanted:
            found[fields["JobId"]] = JobState(fields.get("JobState", "UNKNOWN"), fields.get("NodeList", ""),
                                              "scontrol", {"restarts": fields.get("Restarts", "0")})
    return found, ""


def _in_background(query: tp.Callable, ids: list[str], timeout: float) -> tp.Callable[[float], tuple]:
    """Start ``query(ids, timeout)`` in a thread; the function returned waits for its answer until a
    deadline (``time.monotonic()``), then says it had none."""
    box: dict[str, tuple] = {}
    thread = threading.Thread(target=lambda: box.update(answer=query(ids, timeout)), daemon=True)
    thread.start()

    def result(deadline: float) -> tuple:
        thread.join(max(0.0, deadline - time.monotonic()) + 1.0)  # the query's own timeout ends it by then
        return box.get("answer", (None, f"no answer within {timeout:g} s"))

    return result


def _ask_controller(query: tp.Callable, ids: list[str], deadline: float, timeout: float,
                    probed: bool = False) -> tuple:
    """``query`` (squeue, scontrol) when time is left and the controller listens (``probed``: it
    answered a moment ago), else (None, why)."""
    left = deadline - time.monotonic()
    if left <= 0:
        return None, f"no answer within {timeout:g} s"
    down = "" if probed else controller_down(min(left, PROBE_S))
    if down:
        return None, down
    return query(ids, max(0.1, deadline - time.monotonic()))


def slurm_conf() -> Path | None:
    """The slurm.conf this machine's commands read (``$SLURM_CONF``, else the usual places)."""
    for candidate in [os.environ.get("SLURM_CONF", ""), *SLURM_CONFS]:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def controller_addresses(text: str) -> list[tuple[str, int]]:
    """(host, port) of each slurmctld in a slurm.conf (``SlurmctldHost=name(addr)`` lines, or the old
    ``ControlMachine``/``ControlAddr``); ``SlurmctldPort`` may be a range: its first port."""
    settings: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        key, sep, value = line.partition("=")
        if sep:
            settings.setdefault(key.strip().lower(), []).append(value.strip())
    port = int(re.split(r"[-,]", settings.get("slurmctldport", ["6817"])[-1])[0] or 6817)
    hosts = [re.sub(r"^[^(]*\((.*)\)$", r"\1", h) for h in settings.get("slurmctldhost", [])]
    if not hosts:
        hosts = settings.get("controladdr", []) or settings.get("controlmachine", [])
    return [(h, port) for h in hosts if h]


def _connect(socket: tp.Any, host: str, port: int, timeout: float) -> None:
    """A TCP connect and close; an address literal skips the resolver (getaddrinfo costs ms under load)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect((host, port))
        return
    socket.create_connection((host, port), timeout=timeout).close()


def controller_down(timeout: float) -> str:
    """Why slurmctld cannot be reached (a TCP connect to each controller fails within ``timeout``), or
    "" when one answers or this machine's slurm.conf does not say where it is."""
    import socket  # lazy: startup

    conf = slurm_conf()
    try:
        addresses = controller_addresses(conf.read_text(errors="replace")) if conf else []
    except (OSError, ValueError):
        return ""
    why = ""
    for host, port in addresses:
        try:
            _connect(socket, host, port, timeout)
            return ""
        except OSError as exc:
            why = f"slurmctld at {host}:{port}: {exc.strerror or exc}"
    return why


class SlurmScheduler(Scheduler):
    """sbatch through submitit; sacct where accounting works, else squeue (queued/running), else
    scontrol (recently ended): one batched call each, sacct and squeue at once (sacct's answer wins;
    when squeue has every job queued or running, sacct is not waited for), scontrol only without
    accounting for jobs still unknown, all within one timeout, and squeue/scontrol only when the
    controller listens."""

    kind = "slurm"
    multi_node = True
    allocates_cpus = True

    @staticmethod
    def section_problems(section: tp.Any) -> list[str]:
        return check_sbatch(section.sbatch, owned_options() if section.sbatch else ())

    def cpus_allocated(self, section: tp.Any) -> bool:
        return not overcommits(section)  # --overcommit: tasks share CPUs

    def detect(self, name: str, saved: tp.Mapping[str, str | None]) -> str | None:
        from hpc.schedulers.slurm.detect import detect_site  # lazy: startup

        return detect_site(name, saved.get("topo"), saved.get("query"), saved.get("scontrol"))

    def site_problems(self, site: SiteProfile) -> list[str]:
        if site.node.gpus and site.scheduler.gpu_directive == "none":
            return [f"`scheduler.gpu_directive` = 'none' but `node.gpus` = {site.node.gpus}: "
                    "expected 'gpus-per-node' or 'gres' on a GPU site"]
        return []

    def placement(self, spec: JobSpec, site: SiteProfile) -> Placement:
        """The spec's partition, account and QOS, else the site's ``[scheduler]`` defaults."""
        return tp.cast(Placement, {key: getattr(spec.job, key) or getattr(site.scheduler, key) for key in PLACEMENT})

    def step(self, spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str) -> Step:
        return slurm_step(spec, site, launch, run_dir, python, os.getcwd())

    def container_runtimes(self) -> tp.Mapping[str, ContainerRuntime]:
        return RUNTIMES

    def executor(self, spec: JobSpec, site: SiteProfile, launch: Launch, folder: Path,
                 step: Step | None = None) -> tp.Any:
        from hpc.schedulers.slurm.executor import SlurmExecutor  # lazy: submitit

        run_dir = str(Path(folder).parent)
        step = step or self.step(spec, site, launch, run_dir, sys.executable)
        if step.container:
            prepare_container(spec, site, Path(run_dir), step)
        executor = SlurmExecutor(folder=folder, max_num_timeout=spec.job.max_requeues)
        executor.hpcx_command = step.command
        executor.update_parameters(**slurm_parameters(spec, site, launch, run_dir, sys.executable, step))
        return executor

    def render(self, spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str,
               step: Step | None = None) -> str:
        step = step or self.step(spec, site, launch, run_dir, python)
        params = slurm_parameters(spec, site, launch, run_dir, python, step)
        return render_sbatch(params, step, f"{run_dir}/{SUBMITIT_DIR}")

    def states(self, jobs: tp.Mapping[str, Path], timeout: float = QUERY_TIMEOUT_S) -> dict[str, JobState]:
        deadline = time.monotonic() + timeout
        ids = list(jobs)
        accounting = _in_background(_sacct, ids, timeout)  # the slow one (slurmdbd): overlapped with squeue
        queue, why = _ask_controller(_squeue, ids, deadline, timeout)
        if queue is not None and all(j in queue and not queue[j].done for j in ids):
            return queue  # every job is queued or running: the controller's word is current; no need to wait
        acct, why_acct = accounting(deadline)
        found = {**(queue or {}), **(acct or {})}  # accounting wins where both know a job
        answered, missing = acct is not None or queue is not None, [j for j in ids if j not in found]
        if missing and queue is not None and acct is None:  # no accounting: recently ended jobs
            more, why = _ask_controller(_scontrol, missing, deadline, timeout, probed=True)
            answered, found = answered or more is not None, {**found, **(more or {})}
        why = why or why_acct
        rest = unknown([j for j in jobs if j not in found], "" if answered else UNREACHABLE)
        for state in rest.values():
            state.detail["why"] = why
        return {j: found.get(j) or rest[j] for j in jobs}

    def cancel(self, job_id: str, run_dir: Path) -> bool:
        return try_command(["scancel", job_id])[0]

    def signal(self, job_id: str, signal_name: str, run_dir: Path) -> list[str]:
        """``scancel --signal=SIG JOB``: without ``--batch``/``--full`` it signals every job step but not
        the batch step, which is right: the srun tasks (the trainer ranks) must get it, and the batch
        shell must not (bash dies of USR2, which would end the job)."""
        cmd = ["scancel", f"--signal={signal_name}", job_id]
        ok, why = try_command(cmd)
        if not ok:
            raise UserError([f"{' '.join(cmd)} failed: {why}"])
        return [f"the steps of job {job_id} (scancel --signal={signal_name})"]

    def restarts(self, job_id: str) -> int:
        return int(show_job(job_id).get("Restarts", "0") or 0)

    def on_node(self, job_id: str, host: str, argv: list[str], wait: bool = True) -> str:
        """A step of its own in the job on that node: ``srun --jobid=J --overlap -N1 -n1 -w HOST …``
        (``--overlap``: the training step holds every CPU of the allocation)."""
        cmd = ["srun", f"--jobid={job_id}", "--overlap", "-N1", "-n1", f"--nodelist={host}", *argv]
        return run_on(cmd, wait)

    def submit_prepare(self, folder: Path, site: SiteProfile, python: str, groups: list[int]) -> tuple[str, str]:
        from hpc.schedulers.slurm.array import ARRAY_MINUTES, submit_prepare  # lazy: startup

        return submit_prepare(folder, site.scheduler, python, groups, min(4, site.node.cpus), ARRAY_MINUTES,
                              site.container)


class SlurmJobSide(JobSide):
    """Inside a Slurm job: ``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``, ``scontrol requeue``."""

    kind = "slurm"
    signal_early_s = 60.0  # sbatch(1): "the signal may be sent up to 60 seconds earlier than specified"

    @classmethod
    def started_this_task(cls, env: tp.Mapping[str, str]) -> bool:
        """submitit's Slurm executor, or a task of a plain ``srun`` (a Slurm step, no torchrun); inside a job."""
        executor = env.get("SUBMITIT_EXECUTOR", "")
        if not executor and env.get("SLURM_STEP_ID") and "RANK" not in env:
            executor = "slurm"
        return executor == "slurm" and bool(env.get("SLURM_JOB_ID"))

    @staticmethod
    def rank_env(env: tp.Mapping[str, str]) -> RankEnv | None:
        return ranks.rank_env(env)

    @staticmethod
    def node_local_rank(env: tp.Mapping[str, str]) -> int | None:
        value = env.get("SLURM_LOCALID", "")
        return int(value) if value.isdigit() else None

    def job_id(self) -> str | None:
        return os.environ.get("SLURM_JOB_ID")

    def restart_count(self) -> int:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)

    def requeue(self) -> str | None:
        """``scontrol requeue JOB`` if this incarnation of the job is still the running one.

        A job that is not RUNNING is being cancelled, timed out or already requeued (by Slurm on a node
        failure, say); a restart count different from ours means another incarnation: never requeue then.
        """
        job = self.job_id() or ""
        if request_host_requeue(os.environ, job, self.restart_count()):  # inside an image without scontrol
            _log().warning("requeue of job %s asked of the batch script on the host (after srun)", job)
            return None
        fields = show_job(job)
        state = fields.get("JobState", "UNKNOWN")
        if state != "RUNNING":
            return f"job {job} is {state}, not RUNNING (cancelled, ending or already requeued)"
        ours = str(self.restart_count())
        if fields.get("Restarts", "0") != ours:
            return f"job {job} was already restarted (Restarts={fields.get('Restarts')}, this run is {ours})"
        why = ""
        for attempt in range(REQUEUE_ATTEMPTS):
            ok, why = try_command(["scontrol", "requeue", job], timeout=60)
            now = show_job(job)
            # a busy controller may answer with an error although the requeue went through
            if ok or now.get("JobState") in REQUEUED_STATES or now.get("Restarts", ours) != ours:
                _log().warning("requeued job %s (scontrol requeue)", job)
                return None
            if now.get("JobState") != "RUNNING":
                break
            time.sleep(2.0 * (attempt + 1))
        return f"scontrol requeue {job} failed: {why}"

    def incarnation(self, restart: int) -> str:
        return f"{self.job_id()}.{self.restart_count()}"

    def ended_by(self) -> str | None:
        """The job's state when its task got SIGTERM: scancel marks it CANCELLED and the time limit TIMEOUT
        before their signals go out; a job still RUNNING is srun ending the step after a task failed
        (``--kill-on-bad-exit``), which the batch script's check after srun records."""
        state = show_job(self.job_id() or "").get("JobState", "")
        if state in ("CANCELLED", "TIMEOUT"):
            return "cancel" if state == "CANCELLED" else "time_limit"
        return "step" if state in ("RUNNING", "COMPLETING") and self.decides_failures else None

    def seconds_left(self) -> float | None:
        """``EndTime`` of ``scontrol show job`` (start + time limit) minus now."""
        end = scontrol_seconds(show_job(self.job_id() or "").get("EndTime", ""))
        return None if end is None else end - time.time()

    def await_time_limit(self) -> None:
        """Hold (signals only set flags) until Slurm ends the job at its limit: its state is then TIMEOUT,
        not COMPLETED (the work is not done) nor FAILED (nothing failed). Bounded: the limit plus 2 min."""
        left = self.seconds_left()
        if left is None:
            return
        _log().warning("no requeue left: holding %.0f s until the time limit ends the job (state TIMEOUT)", left)
        deadline = time.monotonic() + max(0.0, left) + 120
        while time.monotonic() < deadline:
            time.sleep(2.0)

    def exclude(self, nodes: tp.Sequence[str]) -> str | None:
        """``scontrol update JobId=J ExcNodeList=…`` of the requeued job (Slurm 22.05 refuses it while
        the job runs; it takes it once ``scontrol requeue`` was granted: COMPLETING, then PENDING)."""
        job = self.job_id() or ""
        ok, why = try_command(["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(nodes)}"], timeout=60)
        return None if ok else f"scontrol update JobId={job} ExcNodeList={','.join(nodes)} failed: {why.strip()}"

    def spare_nodes(self) -> int | None:
        """The nodes of the job's partition (``sinfo``) less the job's own (``SLURM_JOB_NUM_NODES``: the
        ``NumNodes`` of ``scontrol show job`` shrinks while a requeued job completes, node by node)."""
        partition, need = os.environ.get("SLURM_JOB_PARTITION", ""), os.environ.get("SLURM_JOB_NUM_NODES", "")
        if not partition or not need:
            fields = show_job(self.job_id() or "")
            partition, need = fields.get("Partition", ""), fields.get("NumNodes", "").split("-")[0]
        ok, out = try_command(["sinfo", "-h", "-p", partition, "-o", "%D"])
        if not ok or not need.isdigit() or not all(n.strip().isdigit() for n in out.split()):
            return None
        return sum(int(n) for n in out.split()) - int(need)

    def task_ends(self, run_dir: Path) -> list[dict]:
        """srun's lines about this start's tasks in the batch log (``srun_task_ends``)."""
        return srun_task_ends(self.start_log(run_dir))

    def start_log(self, run_dir: Path) -> str:
        """This start's part of the batch log (``this_start``), read from its end: the batch shell's and
        srun's lines, and task 0's stderr, which shares the file (``batch_log``)."""
        path = batch_log(Path(run_dir) / SUBMITIT_DIR, self.job_id() or "")
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - BATCH_LOG_TAIL))
                text = f.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return this_start(text, self.job_id() or "", self.restart_count())

    @property
    def decides_failures(self) -> bool:
        return os.environ.get(CHECK_ENV) == "after-srun"

    def queue_wait(self, run_dir: Path, ledger: list[dict]) -> tuple[float | None, str]:
        """``StartTime - SubmitTime`` of ``scontrol show job`` (Slurm resets SubmitTime on a requeue)."""
        fields = show_job(self.job_id() or "")
        start, submit = scontrol_seconds(fields.get("StartTime", "")), scontrol_seconds(fields.get("SubmitTime", ""))
        if start is not None and submit is not None:
            return max(0.0, start - submit), "scontrol"
        return wait_since_last_stop(run_dir, ledger)
