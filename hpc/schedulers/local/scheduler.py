"""This machine, no scheduler: submitit's local executor.

A local job is submitit's controller process (its pid is the job id); the controller starts one
task process per rank and restarts them all when a task exits with submitit's requeue status (``hpc.compat.local_requeue_exit_code``). ``job.json``
also records the controller's identity (boot and start time), so that a pid the kernel has given to
another process since is never taken for the job (nor signalled). When the controller is gone, the
ledger (a stop after SIGTERM: cancelled) and the result pickle say how the job ended.

On a GPU site the controller is told how many GPUs the tasks share (submitit otherwise exports
``CUDA_VISIBLE_DEVICES=""``); GPUs this shell was limited to (``CUDA_VISIBLE_DEVICES``) are kept.
"""

from __future__ import annotations

import json
import os
import signal as signals
import sys
import time
import typing as tp
from pathlib import Path

from hpc import compat
from hpc.core.errors import UserError
from hpc.core.procs import pid_alive, process_start_time
from hpc.core.runs import RunDir
from hpc.schedulers.base import (QUERY_TIMEOUT_S, SUBMITIT_DIR, JobSide, JobState, Scheduler, read_result,
                                 Step, result_path, run_on, wait_since_last_stop)

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.resolve import Launch
    from hpc.core.site import SiteProfile
    from hpc.core.spec import JobSpec



def job_environment(spec: JobSpec, site: SiteProfile) -> dict[str, str]:
    """Variables exported in every task: the site's NCCL settings, then the spec's `env.set`."""
    env = dict(site.nccl)
    env.update(spec.env.set)
    return dict(sorted(env.items()))


def local_parameters(spec: JobSpec, launch: Launch, visible: str | None = None) -> dict[str, tp.Any]:
    """Keyword arguments of submitit's LocalExecutor for this launch; on a GPU site also the GPUs the
    tasks get (``visible``: this shell's ``CUDA_VISIBLE_DEVICES``, kept when it names GPU indices)."""
    params: dict[str, tp.Any] = {
        "tasks_per_node": launch.tasks_per_node,
        "timeout_min": spec.job.time_limit_min,
        "signal_delay_s": launch.signal_lead_s,
    }
    if launch.gpus_per_node:
        params["gpus_per_node"] = launch.gpus_per_node
        params.update(visible_gpus(visible, launch.gpus_per_node))
    return params


def visible_gpus(visible: str | None, wanted: int) -> dict[str, tp.Any]:
    """``{"visible_gpus": [...]}`` from a ``CUDA_VISIBLE_DEVICES`` value (empty dict when unset);
    UserError when it cannot give ``wanted`` GPUs by index."""
    if visible is None:
        return {}
    names = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(n.isdigit() for n in names):
        raise UserError([f"CUDA_VISIBLE_DEVICES={visible!r}: submitit's local executor hands GPUs out by index; "
                         "export indices (e.g. 0,1) or unset it"])
    if len(names) < wanted:
        raise UserError([f"the site runs {wanted} GPU task(s) on this machine but CUDA_VISIBLE_DEVICES={visible!r} "
                         f"leaves {len(names)} GPU(s) visible"])
    return {"visible_gpus": [int(n) for n in names]}


def pid_identity(pid: int) -> str | None:
    """What tells this process from a later one with the same pid: boot id and start time (clock
    ticks since boot, /proc/PID/stat field 22); None when the process is gone or /proc says nothing."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except (OSError, IndexError):
        return None
    return f"{boot}:{start}"


def controller_alive(job_id: str, run_dir: Path) -> bool:
    """The job's controller still runs: its pid is alive and, when ``job.json`` recorded the
    controller's identity, it is still that process (pids are reused)."""
    pid = int(job_id)
    recorded = RunDir(run_dir).read_job().get("pid_identity")
    if not pid_alive(pid):
        return False
    return recorded is None or pid_identity(pid) == recorded


def task_pids(controller_pid: int) -> list[int]:
    """The processes whose parent is the local controller (its task processes)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="ascii", errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and fields[1] == str(controller_pid) and fields[0] != "Z":
            pids.append(int(entry.name))
    return sorted(pids)


def task_rank(pid: int) -> int | None:
    """The rank of a local task process (its ``SUBMITIT_LOCAL_GLOBALID``), None when unreadable."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            variables = f.read().split(b"\0")
    except OSError:
        return None
    found = [v.split(b"=", 1)[1] for v in variables if v.startswith(b"SUBMITIT_LOCAL_GLOBALID=")]
    return int(found[0]) if found and found[0].isdigit() else None


def cancel_marker(run_dir: Path, job_id: str) -> Path:
    """Written by ``LocalScheduler.cancel`` before its SIGTERM: a controller cancelled before it started
    its tasks (or before they installed their handlers) dies of it with no stop in the ledger and no
    result, and is CANCELLED (as Slurm says of a job cancelled while pending), not FAILED."""
    return Path(run_dir) / SUBMITIT_DIR / f"{job_id}_cancelled"


def local_state(job_id: str, run_dir: Path) -> JobState:
    """RUNNING while the controller lives; then CANCELLED when the ledger's last stop followed a
    SIGTERM (``hpcx cancel``), TIMEOUT when it was the time limit with no requeue left (the controller
    has no such state: rank 0 stops at its signal, saves and leaves), else the result pickle tells
    COMPLETED or FAILED. A task whose code did not load (``hpc.core.failures.loading_failure``) is never
    retried here: the controller restarts tasks only on the trainer's requeue status; FAILED says why."""
    from hpc.core import failures  # lazy: startup (a Slurm site's profile loads this module too)

    if controller_alive(job_id, run_dir):
        return JobState("RUNNING", "localhost", "process")
    stops = [e for e in RunDir(run_dir).read_ledger() if e.get("event") == "stop"]
    last = stops[-1] if stops and str(stops[-1].get("job_id")) == str(job_id) else {}
    if last.get("reason") == "terminated":
        return JobState("CANCELLED", "localhost", "ledger")
    if last.get("reason") == "time_limit" and not last.get("requeued"):
        return JobState("TIMEOUT", "localhost", "ledger")
    result = result_path(Path(run_dir) / SUBMITIT_DIR, job_id)
    outcome = read_result(result) if result.exists() else None
    if outcome is not None and outcome[0] == "success":
        return JobState("COMPLETED", "localhost", "result")
    if cancel_marker(run_dir, job_id).exists():  # `hpcx cancel` before the ranks could record their stop
        return JobState("CANCELLED", "localhost", "cancel", {"reason": "cancelled before its ranks recorded a stop"})
    if outcome is None:
        return JobState("FAILED", "localhost", "process", {"reason": "no result written"})
    loading = failures.loading_failure(str(outcome[1]))
    why = {"reason": f"{loading['error']}, while {loading['where']}: not retried"} if loading else {}
    return JobState("FAILED", "localhost", "result", why)


class LocalScheduler(Scheduler):
    """submitit's ``LocalExecutor`` on this machine."""

    kind = "local"

    def executor(self, spec: JobSpec, site: SiteProfile, launch: Launch, folder: Path,
                 step: Step | None = None) -> tp.Any:
        from hpc.schedulers.local.executor import LocalExecutor  # lazy: submitit

        step = step or self.step(spec, site, launch, str(Path(folder).parent), sys.executable)
        # LocalExecutor directly: AutoExecutor does not pass signal_delay_s through to it
        executor = LocalExecutor(folder=folder, max_num_timeout=spec.job.max_requeues)
        executor.hpcx_command = step.command
        executor.update_parameters(**local_parameters(spec, launch, os.environ.get("CUDA_VISIBLE_DEVICES")))
        return executor

    def render(self, spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str,
               step: Step | None = None) -> str:
        folder = f"{run_dir}/{SUBMITIT_DIR}"
        step = step or self.step(spec, site, launch, run_dir, python)
        params = {"executor": "local", "folder": folder,
                  **local_parameters(spec, launch, os.environ.get("CUDA_VISIBLE_DEVICES")),
                  "environment": job_environment(spec, site), "command": step.command}
        return json.dumps(params, indent=2, sort_keys=True) + "\n"

    def states(self, jobs: tp.Mapping[str, Path], timeout: float = QUERY_TIMEOUT_S) -> dict[str, JobState]:
        return {job: local_state(job, run_dir) for job, run_dir in jobs.items()}

    def job_record(self, job_id: str) -> dict[str, tp.Any]:
        return {"pid_identity": pid_identity(int(job_id))}

    def cancel(self, job_id: str, run_dir: Path) -> bool:
        """SIGTERM to the controller, which forwards it to the tasks and waits for them: the ranks stop
        at their next step boundary. Never sent to a pid that is no longer the job's controller."""
        if not controller_alive(job_id, run_dir):
            return False
        try:
            cancel_marker(run_dir, job_id).touch()
        except OSError:
            pass  # a read-only run folder: a cancel still stops the job, its state may then read FAILED
        try:
            os.kill(int(job_id), signals.SIGTERM)
        except ProcessLookupError:
            return False
        return True

    def signal(self, job_id: str, signal_name: str, run_dir: Path) -> list[str]:
        """Straight to the task processes, the children of the controller (the controller itself has
        no handler for the preemption signal and would die of it)."""
        if not controller_alive(job_id, run_dir):
            raise UserError([f"local job {job_id} has ended (its controller is gone)"])
        pids = task_pids(int(job_id))
        if not pids:
            raise UserError([f"local job {job_id}: no task processes found under its controller"])
        for pid in pids:
            try:
                os.kill(pid, signals.Signals["SIG" + signal_name])
            except ProcessLookupError:
                continue
        return [f"task pid {pid}" for pid in pids]


    def on_node(self, job_id: str, host: str, argv: list[str], wait: bool = True) -> str:
        """Here: every task of a local job runs on this machine."""
        if not pid_alive(int(job_id)):
            raise UserError([f"local job {job_id} has ended (its controller is gone)"])
        return run_on(argv, wait)


class LocalJobSide(JobSide):
    """Inside a task of submitit's local controller: a requeue is leaving with submitit's requeue status (``hpc.compat.local_requeue_exit_code``)."""

    kind = "local"

    def job_id(self) -> str | None:
        return os.environ.get("SUBMITIT_LOCAL_JOB_ID")

    def requeue(self) -> str | None:
        return None  # granted: the task leaves with LOCAL_REQUEUE_EXIT after the stop line

    def seconds_left(self) -> float | None:
        """The controller's time limit less the time since this task started: the controller starts
        its clock as it starts the tasks, afresh after each requeue, and sends the preemption signal
        ``signal_delay_s`` before the end, never earlier (its clock only runs late). The limit is the one
        the controller counts down from (``hpc.compat.local_timeout_s``: ``job.time_limit_min``)."""
        limit = compat.local_timeout_s(os.environ)
        return None if limit is None else limit - (time.time() - process_start_time())

    def await_time_limit(self) -> None:
        """Return at once: the controller would end the tasks at the limit with SIGINT, as if they had
        failed. The job ends here; ``hpcx status`` reads TIMEOUT off the ledger (``local_state``)."""

    def leave_for_requeue(self) -> None:
        import logging  # lazy: startup

        log = logging.getLogger("hpcx.trainer")
        code = compat.local_requeue_exit_code()  # the status submitit's controller restarts the tasks on
        log.warning("requeue: leaving with exit status %d; submitit's local controller restarts the tasks", code)
        for handler in log.handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def queue_wait(self, run_dir: Path, ledger: list[dict]) -> tuple[float | None, str]:
        return wait_since_last_stop(run_dir, ledger)

    def task_ends(self, run_dir: Path) -> list[dict]:
        """The ranks whose task process has ended (no longer a live child of the controller), as one account:
        the controller keeps no order of its own, so the ranks' reports say who failed first."""
        ntasks, controller = os.environ.get("SUBMITIT_LOCAL_NTASKS"), self.job_id()
        if not (ntasks and ntasks.isdigit() and controller and controller.isdigit()):
            return []
        alive = {task_rank(pid) for pid in task_pids(int(controller))}
        gone = sorted(set(range(int(ntasks))) - alive)
        return [{"ranks": gone, "host": "localhost", "what": "ended", "first": True}] if gone else []
