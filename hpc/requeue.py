"""The one requeue of each start of a job: when it is allowed, who asks, and the batch script's check.

An *incarnation* is one start of the job (``JobSide.incarnation``: job id and restart number). Exactly
one party requeues an incarnation: the first to create ``RUN/requeue/<incarnation>.requeued``
(``O_CREAT | O_EXCL``, which shared file systems honour). The parties:

- rank 0, after the ranks agreed on a preemption and saved (``trainer.resilience``);
- rank 0, after a failure, where nothing outside the ranks decides (submitit's local controller, a
  plain ``srun python -m trainer``);
- on Slurm, the batch script's check after srun (``python -m hpc.requeue RUN STATUS``, rendered by
  ``hpc.schedulers.slurm``). srun ends as soon as any task fails (``--kill-on-bad-exit=1``), so this
  one place sees every failure, rank 0 killed without a Python error included (SIGKILL, out of
  memory, the NCCL watchdog). Ranks there only report (``RUN/requeue/<incarnation>.rank-R.json``); the
  check writes the incarnation's stop line from the reports and asks for the requeue unless the policy
  says no. A cancel never reaches it: scancel ends the batch shell too.

Whoever requeues records ``REQUEUED`` in ``states.jsonl``. Torch-free.
"""

from __future__ import annotations

import json
import os
import sys
import time
import typing as tp
from pathlib import Path

from hpc import failures, runs

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


# ---------------------------------------------------------------- the batch script's check after srun


def started_here(ledger: list[dict], side: JobSide) -> int | None:
    """Index of this incarnation's start line (same job id and Slurm restart count), or None."""
    for i in range(len(ledger) - 1, -1, -1):
        e = ledger[i]
        if e.get("event") == "start":
            same = str(e.get("job_id")) == str(side.job_id()) and e.get("slurm_restart_count", 0) == side.restart_count()
            return i if same else None
    return None


def after_srun(run_dir: Path, status: int, side: JobSide) -> dict[str, tp.Any] | None:
    """srun ended with ``status`` ≠ 0: write the stop line no rank wrote and take the one requeue unless
    the policy says no; the line written, or None when rank 0 had recorded this incarnation's stop.

    Who failed and how comes from srun's account of the tasks (``JobSide.task_ends``: the rank that died
    and its signal, not the survivors that lost their connection) and the ranks' reports; the saves this
    start committed from the run folder (``hpc.failures.saves_of``), not from a process that is gone."""
    rd = runs.RunDir(run_dir)
    ledger = rd.read_ledger()
    mine = started_here(ledger, side)
    if mine is not None and any(e.get("event") == "stop" for e in ledger[mine + 1:]):
        return None  # a clean stop (completed, preempted, time limit, terminated): rank 0 decided
    incarnation = side.incarnation(sum(1 for e in ledger if e.get("event") == "start") - (mine is not None))
    reports = failure_reports(run_dir, incarnation)
    step = _failed_step(rd, ledger, mine, reports)
    account = failures.failure_account(reports, _task_ends(side, run_dir), status)
    saves, save_s = _saves(run_dir, incarnation, reports)
    spec = rd.read_resolved().get("spec", {})
    why_not = _policy(spec, ledger, step, side, reports) or request(side, run_dir, incarnation, "batch script",
                                                                     "failed")
    line = stop_line(step, "failed", why_not, side, "batch script", srun_status=status, started=mine is not None,
                     save_s=save_s, saves=saves, **account)
    runs.append_jsonl(rd.ledger, line)
    return line


def _task_ends(side: JobSide, run_dir: Path) -> list[dict]:
    try:
        return side.task_ends(run_dir)
    except (OSError, ValueError):  # the account is a help; the stop line is written without it
        return []


def _saves(run_dir: Path, incarnation: str, reports: list[dict]) -> tuple[int, float]:
    """(saves, seconds) of this start: rank 0's report when it wrote one, else the run folder's record."""
    recorded = failures.saves_of(run_dir, incarnation)
    rank0 = next((r for r in reports if r.get("rank") == 0), None)
    if rank0 is not None and int(rank0.get("saves") or 0) >= recorded[0]:
        return int(rank0.get("saves") or 0), float(rank0.get("save_s") or 0.0)
    return recorded


def _failed_step(rd: runs.RunDir, ledger: list[dict], mine: int | None, reports: list[dict]) -> int:
    """How far the incarnation got: the ranks' reports, else the last metrics line, else where it started."""
    steps = [r["step"] for r in reports if isinstance(r.get("step"), int)]
    if steps:
        return max(steps)
    start = ledger[mine].get("step", 0) if mine is not None else (ledger[-1].get("step", 0) if ledger else 0)
    last = rd.last_metrics() if mine is not None else None
    return max(int(start or 0), int((last or {}).get("step") or 0))


def _policy(spec: dict, ledger: list[dict], step: int, side: JobSide, reports: list[dict]) -> str | None:
    repeating = [r for r in reports if r.get("repeats")]
    if repeating:
        return failures.repeat_reason(repeating[0])
    if not spec.get("checkpoint", {}).get("resume", True):
        return "checkpoint.resume = false: a restart would start over"
    return requeue_verdict(ledger, "failed", step, int(spec.get("job", {}).get("max_requeues", 0)),
                           side.restart_count())


def main(argv: list[str]) -> int:
    """``python -m hpc.requeue RUN_DIR SRUN_STATUS``, run by the batch script when srun failed."""
    if len(argv) != 2 or not argv[1].lstrip("-").isdigit():
        print("usage: python -m hpc.requeue RUN_DIR SRUN_STATUS", file=sys.stderr)
        return 2
    import signal

    from hpc.schedulers.slurm import SlurmJobSide

    # A granted requeue ends the job at once: Slurm sends SIGTERM to the batch shell and to this check,
    # which must still record the stop line and the REQUEUED state (SIGKILL follows only after KillWait).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    line = after_srun(Path(argv[0]), int(argv[1]), SlurmJobSide())
    if line is None:
        print("hpcx: rank 0 recorded how this start ended; nothing to decide after srun", file=sys.stderr)
    elif line["requeued"]:
        print(f"hpcx: requeued after a failure at step {line['step']}: {line['error']}", file=sys.stderr)
    else:
        print(f"hpcx: not requeued: {line.get('not_requeued')} (failure at step {line['step']}: {line['error']})",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
