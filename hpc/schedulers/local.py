"""This machine, no scheduler: submitit's local executor.

A local job is submitit's controller process (its pid is the job id); the controller starts one
task process per rank and restarts them all when a task exits with ``LOCAL_REQUEUE_EXIT``. When the
controller is gone, the result pickle says how the job ended.
"""

from __future__ import annotations

import json
import os
import signal as signals
import time
import typing as tp
from pathlib import Path

from hpc.errors import UserError
from hpc.schedulers.base import (SUBMITIT_DIR, JobSide, JobState, Scheduler, read_result, result_path,
                                 submitit_command)

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.resolve import Launch
    from hpc.site import SiteProfile
    from hpc.spec import JobSpec

# submitit.local.local.LOCAL_REQUEUE_RETURN_CODE: the local controller restarts the tasks on this status
LOCAL_REQUEUE_EXIT = 144


def job_environment(spec: JobSpec, site: SiteProfile) -> dict[str, str]:
    """Variables exported in every task: the site's NCCL settings, then the spec's `env.set`."""
    env = dict(site.nccl)
    env.update(spec.env.set)
    return dict(sorted(env.items()))


def local_parameters(spec: JobSpec, launch: Launch) -> dict[str, tp.Any]:
    """Keyword arguments of submitit's LocalExecutor for this launch."""
    return {
        "tasks_per_node": launch.tasks_per_node,
        "timeout_min": spec.job.time_limit_min,
        "signal_delay_s": launch.signal_lead_s,
    }


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie child of this process counts as finished)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


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


def local_state(job_id: str, submitit_dir: Path) -> JobState:
    """RUNNING while the controller lives; then the result pickle tells COMPLETED or FAILED."""
    if pid_alive(int(job_id)):
        return JobState("RUNNING", "localhost", "process")
    result = result_path(submitit_dir, job_id)
    if not result.exists():
        return JobState("FAILED", "localhost", "process", {"reason": "no result written"})
    outcome = read_result(result)
    return JobState("COMPLETED" if outcome[0] == "success" else "FAILED", "localhost", "result")


class LocalScheduler(Scheduler):
    """submitit's ``LocalExecutor`` on this machine."""

    kind = "local"

    def executor(self, spec: JobSpec, site: SiteProfile, launch: Launch, folder: Path) -> tp.Any:
        import submitit

        # LocalExecutor directly: AutoExecutor does not pass signal_delay_s through to it
        executor = submitit.LocalExecutor(folder=folder, max_num_timeout=spec.job.max_requeues)
        executor.update_parameters(**local_parameters(spec, launch))
        return executor

    def render(self, spec: JobSpec, site: SiteProfile, launch: Launch, run_dir: str, python: str) -> str:
        folder = f"{run_dir}/{SUBMITIT_DIR}"
        params = {"executor": "local", "folder": folder, **local_parameters(spec, launch),
                  "environment": job_environment(spec, site), "command": submitit_command(python, folder)}
        return json.dumps(params, indent=2, sort_keys=True) + "\n"

    def states(self, jobs: tp.Mapping[str, Path]) -> dict[str, JobState]:
        return {job: local_state(job, run_dir / SUBMITIT_DIR) for job, run_dir in jobs.items()}

    def cancel(self, job_id: str, run_dir: Path) -> bool:
        try:
            os.kill(int(job_id), signals.SIGINT)  # submitit's controller stops its tasks on SIGINT
        except ProcessLookupError:
            return False
        return True

    def signal(self, job_id: str, signal_name: str, run_dir: Path) -> list[str]:
        """Straight to the task processes, the children of the controller (the controller itself has
        no handler for the preemption signal and would die of it)."""
        pids = task_pids(int(job_id))
        if not pids:
            raise UserError([f"local job {job_id}: no task processes found under its controller"])
        for pid in pids:
            try:
                os.kill(pid, signals.Signals["SIG" + signal_name])
            except ProcessLookupError:
                continue
        return [f"task pid {pid}" for pid in pids]


def wait_since_last_stop(run_dir: Path, ledger: list[dict]) -> tuple[float | None, str]:
    """This process's start minus the previous stop (after a requeue) or ``job.json``'s ``submitted_at``
    (first start); unknown when the previous incarnation died without a stop line."""
    if ledger and ledger[-1].get("event") == "start":
        return None, "unknown"
    if ledger and ledger[-1].get("event") == "stop":
        reference, source = ledger[-1].get("time"), "ledger"
    else:
        from hpc.runs import RunDir

        reference, source = RunDir(run_dir).read_job().get("submitted_at"), "job.json"
    if reference is None:
        return None, "unknown"
    return max(0.0, process_start_time() - float(reference)), source


def process_start_time() -> float:
    """When this process started (epoch seconds, from /proc), else now."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            boot = time.time() - float(f.read().split()[0])  # btime is whole seconds; uptime has 10 ms
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


class LocalJobSide(JobSide):
    """Inside a task of submitit's local controller: a requeue is leaving with ``LOCAL_REQUEUE_EXIT``."""

    kind = "local"

    def job_id(self) -> str | None:
        return os.environ.get("SUBMITIT_LOCAL_JOB_ID")

    def requeue(self) -> str | None:
        return None  # granted: the task leaves with LOCAL_REQUEUE_EXIT after the stop line

    def leave_for_requeue(self) -> None:
        import logging
        import sys

        log = logging.getLogger("hpcx.trainer")
        log.warning("requeue: leaving with exit status %d; submitit's local controller restarts the tasks",
                    LOCAL_REQUEUE_EXIT)
        for handler in log.handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(LOCAL_REQUEUE_EXIT)

    def queue_wait(self, run_dir: Path, ledger: list[dict]) -> tuple[float | None, str]:
        return wait_since_last_stop(run_dir, ledger)
