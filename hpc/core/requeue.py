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
    previous stop's failure made no progress and is not requeued again, unless that stop excluded the node
    it blamed (``excluded_nodes``, ``hpc.core.health``): the job then ran elsewhere, and a second node's
    fault (a pre-flight check at step 0, say) is not the first failure repeating.
    """
    restarts = max(restarts, sum(1 for e in ledger if e.get("event") == "start") - 1)
    if restarts >= max_requeues:
        return f"job.max_requeues = {max_requeues} reached ({restarts} restarts so far)"
    stops = [e for e in ledger if e.get("event") == "stop"]
    moved = bool(stops and stops[-1].get("excluded_nodes"))
    if reason == "failed" and stops and not moved and stops[-1].get("reason") == "failed" and stops[-1].get("step") == step:
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


# ---------------------------------------------------------------- a start and a stop: the ledger's one definition


def started_here(ledger: list[dict], side: JobSide | None) -> int | None:
    """Index of this start's own start line (the newest start line, when it carries this start's identity:
    the scheduler's job id and restart count), or None. Rank 0 writes that line; another rank (script
    mode's) or the batch script's check after srun may read the ledger before or after it."""
    for i in range(len(ledger) - 1, -1, -1):
        e = ledger[i]
        if e.get("event") == "start":
            same_job = str(e.get("job_id")) == str(side.job_id() if side else None)
            same_count = e.get("slurm_restart_count", 0) == (side.restart_count() if side else 0)
            return i if same_job and same_count else None
    return None


def start_number(ledger: list[dict], side: JobSide | None, own_line_written: bool = False) -> int:
    """This start's number (0 for the job's first start; the ``restart`` of its start line, its
    incarnation where the scheduler does not count restarts): the starts before it. That is the ledger's
    start lines, less this start's own when ``own_line_written`` may be true (a rank other than the one
    that writes it); at least the stop lines (a start that died before its start line, whose stop the
    batch script's check wrote) and the scheduler's own restart count (a requeue the scheduler made when
    the node died with the batch script). The trainer's rank 0 and script mode's every rank ask this."""
    own = started_here(ledger, side) if own_line_written else None
    if own is not None and any(e.get("event") == "stop" for e in ledger[own + 1:]):
        own = None  # an earlier start of the same identity (the local controller's restarts keep their job id)
    starts = sum(1 for i, e in enumerate(ledger) if e.get("event") == "start" and i != own)
    stops = sum(1 for e in ledger if e.get("event") == "stop")
    return max(starts, stops, side.restart_count() if side else 0)


def start_line(step: int, restart: int, side: JobSide | None, by: str, queue_wait: tuple[float | None, str],
               **extra: tp.Any) -> dict[str, tp.Any]:
    """The ledger's line for a start (written by rank 0, of the trainer or of script mode; ``by``): its
    number, the step it starts from, the job's identity and the time it waited in the queue."""
    wait, source = queue_wait
    return {"event": "start", "time": time.time(), "restart": restart, "step": step, "by": by,
            "job_id": side.job_id() if side else None, "slurm_restart_count": side.restart_count() if side else 0,
            "queue_wait_s": None if wait is None else round(wait, 3), "queue_wait_source": source, **extra}


def record_start(run_dir: Path, side: JobSide | None) -> None:
    """RUNNING in ``states.jsonl`` at each start, so the history holds every incarnation whoever polled;
    a requeue the scheduler made on its own (node failure, an admin) shows as REQUEUED before it."""
    states = [s.get("state") for s in runs.RunDir(run_dir).read_states()]
    restarts = side.restart_count() if side is not None else 0
    if restarts > states.count("REQUEUED"):
        record_state(run_dir, "REQUEUED", by="scheduler", restart=restarts)
    record_state(run_dir, "RUNNING", restart=restarts, job_id=side.job_id() if side else None)


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


NO_SCHEDULER = "no scheduler started this process (torchrun or one process): run the same command again to resume"


def ask(side: JobSide | None, run_dir: Path, incarnation: str, reason: str, step: int, max_requeues: int,
        by: str = "rank 0") -> str | None:
    """The one requeue of a start at ``step``, as the trainer and script mode both ask it: the policy
    (``requeue_verdict``: the budget, no progress), then the claim and the scheduler (``request``); None
    when granted, else why not."""
    restarts = side.restart_count() if side is not None else 0
    why_not = requeue_verdict(runs.RunDir(run_dir).read_ledger(), reason, step, max_requeues, restarts)
    if why_not is not None:
        return why_not
    if side is None:
        return NO_SCHEDULER
    return request(side, run_dir, incarnation, by, reason)


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
