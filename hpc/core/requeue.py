"""The one requeue of each start of a job: when it is allowed, who asks, and the batch script's check.

An *incarnation* is one start of the job (``JobSide.incarnation``: job id and restart number). Exactly
one party requeues an incarnation: the first to create ``RUN/requeue/<incarnation>.requeued``
(``O_CREAT | O_EXCL``, which shared file systems honour). The parties:

- rank 0, after the ranks agreed on a preemption and saved (``trainer.resilience``);
- rank 0, after a failure, where nothing outside the ranks decides (submitit's local controller, a
  plain ``srun python -m trainer``);
- on Slurm, the batch script's check after srun (``python -m hpc.requeue RUN STATUS``, rendered by
  ``hpc.schedulers.slurm.scheduler``; ``hpc.schedulers.slurm.requeue``). srun ends as soon as any task
  fails (``--kill-on-bad-exit=1``), so this one place sees every failure, rank 0 killed without a Python error included (SIGKILL, out of
  memory, the NCCL watchdog). Ranks there only report (``RUN/requeue/<incarnation>.rank-R.json``); the
  check writes the incarnation's stop line from the reports and asks for the requeue unless the policy
  says no. A cancel never reaches it: scancel ends the batch shell too.

Whoever requeues records ``REQUEUED`` in ``states.jsonl``. Torch-free.
"""

from __future__ import annotations

import json
import os
import time
import typing as tp
from pathlib import Path

from hpc.core import runs

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.schedulers.base import JobSide


# ---------------------------------------------------------------- the policy (pure)


def requeue_verdict(ledger: list[dict], reason: str, step: int, max_requeues: int, restarts: int = 0) -> str | None:
    """None when one more requeue is allowed, else why not (``ledger`` as read before this stop's line).

    Restarts so far: the ledger's start lines beyond the first, or the scheduler's count (``restarts``)
    when larger (an incarnation that died before its start line). A failure at the same step as the
    previous stop's failure made no progress and is not requeued again.
    """
    restarts = max(restarts, sum(1 for e in ledger if e.get("event") == "start") - 1)
    if restarts >= max_requeues:
        return f"job.max_requeues = {max_requeues} reached ({restarts} restarts so far)"
    stops = [e for e in ledger if e.get("event") == "stop"]
    if reason == "failed" and stops and stops[-1].get("reason") == "failed" and stops[-1].get("step") == step:
        return f"failed twice at step {step} without progress"
    return None


def stop_line(step: int, reason: str, why_not: str | None, side: JobSide | None, by: str,
              **extra: tp.Any) -> dict[str, tp.Any]:
    """The ledger's line for the stop of an incarnation (``reason``: completed, preempted, terminated,
    failed); ``why_not`` is why it was not requeued (None: requeued, or nothing to requeue)."""
    line = {"event": "stop", "time": time.time(), "step": step, "reason": reason, "by": by,
            "requeued": why_not is None and reason not in ("completed", "terminated"),
            "job_id": side.job_id() if side else None, "slurm_restart_count": side.restart_count() if side else 0,
            **extra}
    if why_not is not None and reason != "completed":
        line["not_requeued"] = why_not
    return line


# ---------------------------------------------------------------- claims and reports (the run folder)


def claim(run_dir: Path, incarnation: str, by: str, reason: str) -> bool:
    """Take the one requeue of ``incarnation``; False when another party already took it."""
    folder = runs.RunDir(run_dir).requeue
    folder.mkdir(exist_ok=True)
    try:
        fd = os.open(folder / f"{incarnation}.requeued", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"by": by, "reason": reason, "time": time.time()}) + "\n")
    return True


def request(side: JobSide, run_dir: Path, incarnation: str, by: str, reason: str) -> str | None:
    """The one requeue of this incarnation: claim it, then ask the scheduler; None when granted, else why
    not. The granted requeue is recorded as ``REQUEUED`` in ``states.jsonl``."""
    if not claim(run_dir, incarnation, by, reason):
        return f"this start ({incarnation}) was already requeued by another party"
    why_not = side.requeue()
    if why_not is None:
        record_state(run_dir, "REQUEUED", by=by, reason=reason, incarnation=incarnation)
    return why_not


def record_state(run_dir: Path, state: str, **fields: tp.Any) -> None:
    """Append a state the job itself knows (RUNNING at a start, REQUEUED) to ``states.jsonl``."""
    runs.append_jsonl(runs.RunDir(run_dir).states, {"state": state, "time": time.time(), **fields})


def report_failure(run_dir: Path, incarnation: str, rank: int, **fields: tp.Any) -> None:
    """A rank's account of its failure (step, error, …), for whoever writes the stop line."""
    folder = runs.RunDir(run_dir).requeue
    folder.mkdir(exist_ok=True)
    runs.write_json(folder / f"{incarnation}.rank-{rank}.json", {"rank": rank, "time": time.time(), **fields})


def failure_reports(run_dir: Path, incarnation: str) -> list[dict]:
    """The ranks' reports of this incarnation, first failure first."""
    folder = runs.RunDir(run_dir).requeue
    found = [runs.read_json(p) for p in folder.glob(f"{incarnation}.rank-*.json")] if folder.is_dir() else []
    return sorted(found, key=lambda r: r.get("time", 0.0))
