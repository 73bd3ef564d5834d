"""The scheduler interface: what hpcx asks of Slurm, or of this machine, on either side of a submission.

Login side (``Scheduler``): the submitit executor and the exact text ``hpcx render`` shows; the
state of many jobs in one bounded query; cancel; sending the preemption signal (``hpcx drill``); how
often the scheduler restarted a job.

Job side (``JobSide``, inside a running task): this job's id and restart count; asking for the one
requeue (``hpc.core.requeue`` makes sure it is one) and leaving the way that scheduler restarts a job; how
long this incarnation waited in the queue.

Every task runs ``task_command``: the preemption signal and SIGTERM are held from the task's start
(``env --block-signal``, else the first line of ``trainer.entry``) until the trainer's flag handler
takes them.

Adding a scheduler (PBS, Kubernetes …) is adding one module beside ``slurm.py`` and ``local.py`` and
one line in ``hpc.schedulers.KINDS``. Everything here is torch-free; submitit is imported lazily.
"""

from __future__ import annotations

import abc
import os
import re
import subprocess
import sys
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

from hpc.compat import ExecutorHooks
from hpc.core import procs
from hpc.core.boot import python_command
from hpc.core.errors import UserError
from hpc.core.runs import SUBMITIT_DIR, RunDir

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.resolve import Launch
    from hpc.core.site import SiteProfile
    from hpc.core.spec import JobSpec

PORT_BASE = 20000
PORT_SPAN = 20000
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE", "FINISHED", "INTERRUPTED"}
QUERY_TIMEOUT_S = 30.0
UNREACHABLE = "scheduler unreachable"
PLACEMENT = ("partition", "account", "qos")  # what a job asks of any batch scheduler (``Scheduler.placement``)


class Placement(tp.TypedDict):
    """``Scheduler.placement``: the ``PLACEMENT`` fields as ``Launch`` records them."""

    partition: str | None
    account: str | None
    qos: str | None


@dataclass
class JobState:
    state: str
    nodes: str = ""
    source: str = ""  # which command answered
    detail: dict = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def words(self) -> str:
        """The state for people: ``unknown (scheduler unreachable)`` when nobody could say."""
        if self.state == "UNKNOWN" and self.detail.get("reason"):
            return f"unknown ({self.detail['reason']})"
        if self.detail.get("recorded"):
            return f"{self.state} (recorded in the run folder; {self.detail.get('reason') or UNREACHABLE})"
        if self.detail.get("reason"):
            return f"{self.state} ({self.detail['reason']})"
        return self.state


@dataclass
class RankEnv:
    """Where this process sits in the job, and how to reach rank 0 (``JobSide.rank_env`` of the scheduler
    that started it, or the trainer's own reading of submitit and torchrun)."""

    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    hostname: str = field(default_factory=lambda: _hostname())
    local_world_size: int = 1
    launcher: str = "single"  # "submitit", "torchrun", "srun" or "single"
    agent_store: bool = False  # torchrun's agent already hosts the TCPStore at master_port

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def _hostname() -> str:
    import socket  # lazy: startup (`hpcx status` imports this module and never builds a RankEnv)

    return socket.gethostname()


def rendezvous_port(job_id: str) -> int:
    """A port from the job id, so two jobs sharing a node do not collide: 20000 + digits % 20000."""
    digits = re.sub(r"\D", "", job_id)
    return PORT_BASE + (int(digits) % PORT_SPAN if digits else 0)


def unknown(jobs: tp.Iterable[str], reason: str = "") -> dict[str, JobState]:
    """State UNKNOWN for each job, with why (e.g. ``UNREACHABLE``) when known."""
    return {j: JobState("UNKNOWN", source="none", detail={"reason": reason} if reason else {}) for j in jobs}


def on_path(name: str) -> bool:
    """Whether ``name`` is an executable file on $PATH (or, holding a slash, at that path): ``shutil.which``'s
    test, without importing shutil (and its compression modules) before every scheduler query."""
    paths = [name] if os.sep in name else [os.path.join(d, name) for d in os.get_exec_path() if d]
    return any(os.path.isfile(p) and os.access(p, os.X_OK) for p in paths)


def run_command(cmd: list[str], timeout: float = QUERY_TIMEOUT_S) -> str | None:
    """stdout of ``cmd`` (an argument list, never a shell) when it exits 0 within ``timeout``, else None."""
    ok, out = try_command(cmd, timeout)
    return out if ok else None


def try_command(cmd: list[str], timeout: float = QUERY_TIMEOUT_S) -> tuple[bool, str]:
    """(exited 0 within ``timeout``, its stdout — or, when it failed, why: stderr, exit status, timeout)."""
    if procs.asked is not None:
        procs.asked.append(list(cmd))
    proc = procs.take_ahead(cmd)  # the same command, started before this process had loaded the code that asks
    if proc is None:
        if not on_path(cmd[0]):
            return False, f"{cmd[0]}: command not found"
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        except OSError as exc:
            return False, str(exc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # as subprocess.run: killed and reaped, its pipes not read to the end
        proc.kill()
        proc.wait()
        return False, f"no answer within {timeout:g} s"
    except BaseException:  # Ctrl-C while waiting: as subprocess.run, never leave the query running
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        return False, err.strip() or f"exit status {proc.returncode}"
    return True, out


def run_on(cmd: list[str], wait: bool) -> str:
    """Run ``cmd`` (an argument list) to its end (UserError when it fails), or start it detached from
    this process (its own session, no terminal: it outlives ``hpcx drill``); ``cmd`` as words."""
    import shlex  # lazy: startup

    if wait:
        ok, why = try_command(cmd, timeout=60)
        if not ok:
            raise UserError([f"{shlex.join(cmd)} failed: {why.strip()}"])
    else:
        subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    return shlex.join(cmd)


def read_result(path: Path) -> tuple[str, object]:
    """submitit's result pickle: ("success", value) or ("error", traceback text).

    Read with ``plain_unpickler``: both outcomes of hpcx's ``TrainTask`` are plain values (rank 0's
    summary: numbers, strings, lists, a dict; or the traceback's text), which pickle builds from its own
    opcodes without naming a class. A plain ``pickle.load`` would import and call whatever the file
    names, as the user who runs ``hpcx status``; the file is the job's, but a run folder may be copied,
    shared or written by a job gone wrong, and reading a state must not run code from it.
    """
    try:
        with open(path, "rb") as f:
            return plain_unpickler(f).load()
    except Exception as exc:  # noqa: BLE001 - report any unreadable result as such
        return ("error", f"unreadable result {path}: {exc}")


def plain_unpickler(f: tp.BinaryIO) -> tp.Any:
    """An unpickler that refuses every class and function (``find_class``): plain values only."""
    import pickle  # lazy: startup (only a finished local job's state needs it, never the list of Slurm runs)

    class Plain(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> tp.Any:
            raise pickle.UnpicklingError(f"it names {module}.{name}; hpcx reads plain values only")

    return Plain(f)


# How a task starts: USR2 ignored by the shell at once, then, where coreutils' env can (8.31+), USR2 and
# SIGTERM blocked across the exec of python, so they stay pending (a blocked signal is kept even while
# ignored) until the trainer's handler unblocks them; elsewhere trainer.entry blocks them at its first line.
TASK_SHELL = ('trap "" USR2; env --block-signal=USR2 true 2>/dev/null && '
              'exec env --block-signal=USR2 --block-signal=TERM "$@"; exec "$@"')
TASK_WRAPPER = ["/bin/sh", "-c", TASK_SHELL, "hpcx-task"]


def task_argv(python: str, folder: str) -> list[str]:
    """``task_command`` as its words."""
    return [*TASK_WRAPPER, *python_command(python, "trainer.entry", str(folder), unbuffered=True)]


def task_command(python: str, folder: str) -> str:
    """The command every task runs (in the sbatch script's srun line, or by the local controller):
    ``python -u -m trainer.entry FOLDER`` (submitit's ``_submit`` with the signals held) as
    ``python -u -c BOOT trainer.entry FOLDER`` (``hpc.core.imports``: hpcx's own ``hpc`` and ``trainer``,
    whatever the submit folder holds), started so that a preemption signal or a SIGTERM that comes
    before the trainer's handler waits for it instead of killing the task or being dropped (``TASK_SHELL``)."""
    import shlex  # lazy: startup

    return shlex.join(task_argv(python, folder))


@dataclass(frozen=True)
class Step:
    """The step of one submission, built once per submit (``Scheduler.step``): ``render``, the executor and
    the batch script are all rendered from this one value (``hpcx render`` shows what ``hpcx submit`` sends)."""

    argv: tuple[str, ...]  # each task's command (in the image, with a container)
    setup: tuple[str, ...] = ()  # the batch shell's lines before the step: the job's environment, the runtime's
    teardown: tuple[str, ...] = ()  # the batch shell's lines after it (the check after srun, the host's requeue)
    srun_args: tuple[str, ...] = ()  # the container runtime's flags on the step line
    mounts: tuple[tp.Any, ...] = ()  # what each task sees besides the image (``hpc.core.container.Mount``)
    links: tuple[tuple[str, str], ...] = ()  # the container's overlay: (name, host path) of hpcx's code
    container: bool = False  # the step runs in the site's container image

    @property
    def command(self) -> str:
        import shlex  # lazy: startup

        return shlex.join(self.argv)


class ContainerRuntime(tp.Protocol):
    """One container runtime (``[container] runtime``): what it takes and how it puts a step in the image. A
    scheduler kind lists the runtimes it runs (``Scheduler.container_runtimes``); ``hpc.core.container``
    checks a profile against them, the kind's step asks them (Slurm's: ``hpc/schedulers/slurm/container.py``)."""

    name: str
    list_syntax: str  # characters its mount list reads as syntax (a derived path holding one is refused)
    binds_node_devices: bool  # the node's /dev/infiniband and /dev/shm are bound in (else the runtime gives them)
    takes_uris: bool  # an image given by URI (docker://…), pulled on the node
    enroot_names: bool  # an enroot image name (`nvcr.io#nvidia/pytorch:…`, `ubuntu:24.04`)
    image_folder: bool  # the image is a folder (an OCI bundle), not a file

    def problems(self, c: tp.Any, prefix: str, gpus: int) -> list[str]:
        """This runtime's own rules on a ``[container]`` section (the keys only it reads)."""
        ...

    def wrap(self, argv: list[str], c: tp.Any, run_dir: str, mounts: list[tp.Any], workdir: str,
             gpus: bool) -> tp.Any:
        """The step's flags, argv and setup lines for the task command ``argv`` in the image."""
        ...

    def prepare(self, c: tp.Any, run_dir: Path, mounts: list[tp.Any], workdir: str, where: str, gpus: int,
                source: str) -> None:
        """At submit, what the nodes need besides the overlay (an OCI bundle, its task script)."""
        ...


class TaskCommand(ExecutorHooks):
    """Mixed into submitit's executors: their tasks run ``hpcx_command`` (the submission's ``Step``), else
    ``task_command`` (through submitit's private hook, which only ``hpc.compat`` names; tests/test_render.py
    checks the submitted text)."""

    hpcx_command: str | None = None

    def task_command_text(self) -> str:
        if self.hpcx_command:
            return self.hpcx_command
        return task_command(sys.executable, str(self.folder))  # type: ignore[attr-defined]


def result_path(submitit_dir: Path, job_id: str) -> Path:
    """Where submitit leaves rank 0's result (or error) of a job."""
    return submitit_dir / f"{job_id}_0_result.pkl"


def batch_log(submitit_dir: Path, job_id: str) -> Path:
    """The batch script's stderr (shared with task 0's): where srun says which task ended how."""
    return submitit_dir / f"{job_id}_0_log.err"


class Scheduler(abc.ABC):
    """The login side of one scheduler kind."""

    kind: str = ""
    multi_node: bool = False  # one job can span several nodes
    allocates_cpus: bool = False  # each task gets CPUs of its own (more tasks than CPUs are refused)

    def step(self, spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str) -> Step:
        """The submission's step, built once per submit (``hpc.login.submit``) and handed to ``render`` and
        ``executor``: here ``task_command`` as it is; a kind with containers puts it in the site's image."""
        return Step(tuple(task_argv(python, f"{run_dir}/{SUBMITIT_DIR}")))

    def container_runtimes(self) -> tp.Mapping[str, ContainerRuntime]:
        """The container runtimes this kind runs, by name (``[container] runtime``); none: only ``none``."""
        return {}

    @abc.abstractmethod
    def executor(self, spec: JobSpec, site: SiteProfile, launch: Launch, folder: Path,
                 step: Step | None = None) -> tp.Any:
        """A submitit executor configured for this launch; ``folder`` is the run's submitit folder; ``step``
        the submission's (``self.step``, built here when not given)."""

    @abc.abstractmethod
    def render(self, spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str,
               step: Step | None = None) -> str:
        """Exactly what ``executor`` submits (the sbatch script, or the local parameters), from ``step``."""

    @abc.abstractmethod
    def states(self, jobs: tp.Mapping[str, Path], timeout: float = QUERY_TIMEOUT_S) -> dict[str, JobState]:
        """The state of every job id in ``jobs`` (id -> its run folder), in as few queries as the
        scheduler allows and within ``timeout`` seconds; a job the scheduler cannot tell about gets
        state UNKNOWN (with ``detail["reason"]`` = ``UNREACHABLE`` when the scheduler did not answer)."""

    def job_record(self, job_id: str) -> dict[str, tp.Any]:
        """What ``job.json`` keeps about a just-submitted job besides its id (e.g. how to recognise it)."""
        return {}

    @abc.abstractmethod
    def cancel(self, job_id: str, run_dir: Path) -> bool:
        """Ask the job to stop (its ranks get SIGTERM and stop at their next step boundary); False
        when the scheduler refused or the job was not there."""

    @abc.abstractmethod
    def signal(self, job_id: str, signal_name: str, run_dir: Path) -> list[str]:
        """Send ``signal_name`` (e.g. USR2) to the job's training tasks; what was signalled, for the report.
        Raises UserError when it cannot."""

    def restarts(self, job_id: str) -> int:
        """How many times the scheduler restarted (requeued) the job."""
        return 0

    def on_node(self, job_id: str, host: str, argv: list[str], wait: bool = True) -> str:
        """Run ``argv`` on ``host``, a node of the running job (``hpcx drill``'s faults: a signal to one
        rank's process); with ``wait``, until it ends (UserError when it fails), else left running.
        What was run, for the report."""
        raise UserError([f"a {self.kind} job: hpcx cannot run a command on its nodes"])

    def submit_prepare(self, folder: Path, site: SiteProfile, python: str, groups: list[int]) -> tuple[str, str]:
        """``hpcx data prepare --site``: the unfinished ``groups`` of the preparation in ``folder`` as jobs,
        then its merge job; (id of the group jobs, id of the merge job). Not every kind can."""
        raise UserError([f"--site {site.name}: a {self.kind} site: expected a Slurm site for a job array "
                         "(without --site, prepare runs here)"])

    @staticmethod
    def section_problems(section: tp.Any) -> list[str]:
        """This kind's rules on the options it owns in a site's ``[scheduler]`` section (well-typed)."""
        return []

    def cpus_allocated(self, section: tp.Any) -> bool:
        """Whether a site's tasks get CPUs of their own under its ``[scheduler]`` section
        (``allocates_cpus``, unless the section says otherwise): then a node runs at most its CPUs' tasks."""
        return self.allocates_cpus

    def detect(self, name: str, saved: tp.Mapping[str, str | None]) -> str | None:
        """``hpcx site detect``: a draft profile named ``name`` (TOML) of this machine, or from the saved
        tool outputs in ``saved`` (option -> path); None when this kind does not draft profiles."""
        return None

    def site_problems(self, site: SiteProfile) -> list[str]:
        """This kind's cross-checks of a well-typed site profile of its kind."""
        return []

    def placement(self, spec: JobSpec, site: SiteProfile) -> Placement:
        """Where the job asks to run, as ``Launch`` records it (``partition``, ``account``, ``qos``): the
        spec's ``job.partition``/``account``/``qos``; a kind whose ``[scheduler]`` section has defaults
        for them (Slurm's) fills what the spec leaves out. The core reads no field of a kind's section."""
        return tp.cast(Placement, {key: getattr(spec.job, key) for key in PLACEMENT})


class JobSide(abc.ABC):
    """The side of one scheduler kind that runs inside a job's task."""

    kind: str = ""
    # How much earlier than its lead this scheduler may send the time-limit signal (Slurm: up to 60 s,
    # sbatch(1)); what the trainer allows before calling a signal a preemption rather than the time limit.
    signal_early_s: float = 0.0

    @classmethod
    def started_this_task(cls, env: tp.Mapping[str, str]) -> bool:
        """Whether this kind started the process with environment ``env`` (submitit names its executor)."""
        return env.get("SUBMITIT_EXECUTOR") == cls.kind

    @staticmethod
    def rank_env(env: tp.Mapping[str, str]) -> RankEnv | None:
        """This task's rank when this kind started it itself, without submitit or torchrun; else None."""
        return None

    @staticmethod
    def node_local_rank(env: tp.Mapping[str, str]) -> int | None:
        """This task's index among its node's tasks where this kind sets it in every task (also inside a
        container, before the trainer reads its rank); None when it does not."""
        return None

    @abc.abstractmethod
    def job_id(self) -> str | None:
        """This job's id."""

    def restart_count(self) -> int:
        """How many times this job was restarted before this incarnation."""
        return 0

    def incarnation(self, restart: int) -> str:
        """A name for this start of the job (``JOBID.RESTART``); ``restart`` is the ledger's count of
        earlier starts, for schedulers that do not count restarts themselves."""
        return f"{self.job_id()}.{restart}"

    @property
    def decides_failures(self) -> bool:
        """Whether something outside the ranks decides the requeue after a failure (the batch
        script's check after srun); then a failing rank only reports (``hpc.core.requeue``)."""
        return False

    @abc.abstractmethod
    def requeue(self) -> str | None:
        """Ask the scheduler for a requeue of this job; None when granted, else why not. Call it
        through ``hpc.core.requeue.request``, which makes it the only one of this incarnation."""

    def leave_for_requeue(self) -> None:
        """After a granted requeue and the stop line: leave the way this scheduler restarts a job
        (returning is right where the scheduler itself restarts the tasks)."""

    def ended_by(self) -> str | None:
        """After this task got SIGTERM, who is ending it, where the scheduler can tell: ``cancel``,
        ``time_limit``, or ``step`` (another task of the step failed and the scheduler ends the rest: the
        check after srun records that failure); None when it cannot tell (then it is taken as a cancel)."""
        return None

    @abc.abstractmethod
    def queue_wait(self, run_dir: Path, ledger: list[dict]) -> tuple[float | None, str]:
        """(seconds this incarnation waited in the queue, where that figure came from)."""

    def seconds_left(self) -> float | None:
        """Seconds until this incarnation's time limit; None when there is none or nobody can tell."""
        return None

    def await_time_limit(self) -> None:
        """After a stop at the time-limit signal that was not requeued: return once the job may end.
        A scheduler that records TIMEOUT only when the limit itself ends the job holds until then; one
        whose state hpcx reads off the ledger (local: ``time_limit``, not requeued) returns at once."""

    def start_log(self, run_dir: Path) -> str:
        """What this start's task 0 wrote to stderr, where the scheduler keeps it, for a failure no rank
        could report (the job's code did not load: ``hpc.core.failures.loading_failure``); "" if none."""
        return ""

    def task_ends(self, run_dir: Path) -> list[dict]:
        """The scheduler's account of this start's tasks that ended badly, in order (``ranks``, ``host``,
        ``what``, ``signal`` or ``exit_code``, ``first``: before the rest were ended); [] when it has none."""
        return []

    def exclude(self, nodes: tp.Sequence[str]) -> str | None:
        """After a granted requeue: keep the next start off ``nodes`` (exactly these: an empty list lets
        every node back, ``hpc.core.health``); None when done, else why not."""
        return f"a {self.kind or 'this'} job cannot exclude nodes" if nodes else None

    def spare_nodes(self) -> int | None:
        """Nodes of the job's partition it does not need (how many may be excluded); None: unknown."""
        return None


def wait_since_last_stop(run_dir: Path, ledger: list[dict]) -> tuple[float | None, str]:
    """This process's start minus the previous stop (after a requeue) or ``job.json``'s ``submitted_at``
    (first start); unknown when the previous incarnation died without a stop line. What a scheduler
    that cannot tell its queue wait answers (``JobSide.queue_wait``), and the trainer without one."""
    if ledger and ledger[-1].get("event") == "start":
        return None, "unknown"
    if ledger and ledger[-1].get("event") == "stop":
        reference, source = ledger[-1].get("time"), "ledger"
    else:
        reference, source = RunDir(run_dir).read_job().get("submitted_at"), "job.json"
    if reference is None:
        return None, "unknown"
    return max(0.0, procs.process_start_time() - float(reference)), source
