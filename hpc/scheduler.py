"""Asking the scheduler about a job: Slurm (sacct, then squeue, then scontrol) or a local process.

Commands are run as argument lists (never through a shell) with a timeout.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE", "FINISHED", "INTERRUPTED"}


@dataclass
class JobState:
    state: str
    nodes: str = ""
    source: str = ""  # which command answered
    detail: dict = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL


def _run(cmd: list[str], timeout: float = 30) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _sacct(job_id: str) -> JobState | None:
    out = _run(["sacct", "-j", job_id, "-X", "-n", "-P", "--format=JobID,State,NodeList,ExitCode"])
    if not out or not out.strip():
        return None
    # with requeues sacct may list older records first; the last line is the current one
    fields = out.strip().splitlines()[-1].split("|")
    state = fields[1].split()[0] if len(fields) > 1 and fields[1] else "UNKNOWN"
    return JobState(state, fields[2] if len(fields) > 2 else "", "sacct",
                    {"exit_code": fields[3] if len(fields) > 3 else ""})


def _squeue(job_id: str) -> JobState | None:
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%N"])
    if not out or not out.strip():
        return None
    state, _, nodes = out.strip().splitlines()[0].partition("|")
    return JobState(state, nodes, "squeue")


def _scontrol(job_id: str) -> JobState | None:
    out = _run(["scontrol", "-o", "show", "job", job_id])
    if not out:
        return None
    pairs = dict(tok.split("=", 1) for tok in out.split() if "=" in tok)
    return JobState(pairs.get("JobState", "UNKNOWN"), pairs.get("NodeList", ""), "scontrol",
                    {"restarts": pairs.get("Restarts", "0")})


def slurm_restarts(job_id: str) -> int:
    """How many times Slurm has restarted (requeued) the job, from ``scontrol show job``."""
    state = _scontrol(job_id)
    return int(state.detail.get("restarts", "0")) if state else 0


def slurm_state(job_id: str) -> JobState:
    """sacct where accounting works, else squeue (queued/running), else scontrol (recently ended)."""
    for query in (_sacct, _squeue, _scontrol):
        state = query(job_id)
        if state is not None:
            return state
    return JobState("UNKNOWN", source="none")


def local_state(job_id: str, submitit_dir: Path) -> JobState:
    """A local job is its submitit controller process; when it is gone, the result pickle tells."""
    if _pid_alive(int(job_id)):
        return JobState("RUNNING", "localhost", "process")
    result = submitit_dir / f"{job_id}_0_result.pkl"
    if not result.exists():
        return JobState("FAILED", "localhost", "process", {"reason": "no result written"})
    outcome = read_result(result)
    state = "COMPLETED" if outcome[0] == "success" else "FAILED"
    return JobState(state, "localhost", "result")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process counts as finished
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def read_result(path: Path) -> tuple[str, object]:
    """submitit's result pickle: ("success", value) or ("error", traceback text).

    It is a file the job (this user's own code) wrote into a 0700 folder.
    """
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception as exc:  # noqa: BLE001 - report any unreadable result as such
        return ("error", f"unreadable result {path}: {exc}")


def cancel_slurm(job_id: str) -> bool:
    return _run(["scancel", job_id]) is not None


def cancel_local(job_id: str) -> bool:
    import signal

    try:
        os.kill(int(job_id), signal.SIGINT)  # submitit's controller stops its tasks on SIGINT
    except ProcessLookupError:
        return False
    return True
