"""The batch script's check after srun (``python -m hpc.requeue RUN STATUS``): Slurm's part of the one
requeue of each start (``hpc.core.requeue`` holds the policy and the claim every kind shares).

srun ends as soon as any task fails (``--kill-on-bad-exit=1``), so this one place sees every failure,
rank 0 killed without a Python error included. It writes the incarnation's stop line from the ranks'
reports and asks for the requeue unless the policy says no. Torch-free.
"""

from __future__ import annotations

import signal
import sys
import time
import typing as tp
from pathlib import Path

from hpc.core import failures, health, straggler
from hpc.core.requeue import failure_reports, request, requeue_verdict, start_number, started_here, stop_line
from hpc.core.runs import RunDir, append_jsonl
from hpc.schedulers.slurm.scheduler import SlurmJobSide

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.schedulers.base import JobSide


def after_srun(run_dir: Path, status: int, side: JobSide) -> dict[str, tp.Any] | None:
    """srun ended with ``status`` ≠ 0: write the stop line no rank wrote and take the one requeue unless
    the policy says no; the line written, or None when rank 0 had recorded this incarnation's stop.

    Who failed and how comes from srun's account of the tasks (``JobSide.task_ends``: the rank that died
    and its signal, not the survivors that lost their connection) and the ranks' reports; the saves this
    start committed from the run folder (``hpc.core.failures.saves_of``), not from a process that is gone.
    A start that failed before the trainer ran (no start line, no report) because python could not load
    the job's code (``hpc.core.failures.loading_failure``: an import or unpickling error) is not
    requeued: it would fail the same way."""
    rd = RunDir(run_dir)
    ledger = rd.read_ledger()
    mine = started_here(ledger, side)
    if mine is not None and any(e.get("event") == "stop" for e in ledger[mine + 1:]):
        return None  # a clean stop (completed, preempted, time limit, terminated): rank 0 decided
    incarnation = side.incarnation(start_number(ledger, side, own_line_written=True))
    reports = failure_reports(run_dir, incarnation)
    step = _failed_step(rd, ledger, mine, reports)
    ends = _task_ends(side, run_dir)
    account = failures.failure_account(reports, ends, status)
    loading = _loading_failure(side, run_dir) if mine is None and not reports else None
    if loading is not None:  # the job's code did not load: its own error, not srun's words for the exit
        account.update(error=loading["error"], module=loading["module"])
    saves, save_s = _saves(run_dir, incarnation, reports)
    spec = rd.read_resolved().get("spec", {})
    why_not = ((failures.loading_reason(loading) if loading else _policy(spec, ledger, step, side, reports))
               or request(side, run_dir, incarnation, "batch script", "failed"))
    named = straggler.of_start(run_dir, incarnation)  # the ranks named slow during this start (hpc.core.straggler)
    account.update({"stragglers": named} if named else {})
    account.update(node_health(ledger, spec, side, account, reports, ends, requeued=why_not is None))
    line = stop_line(step, "failed", why_not, side, "batch script", srun_status=status, started=mine is not None,
                     save_s=save_s, saves=saves, **account)
    append_jsonl(rd.ledger, line)
    return line


def node_health(ledger: list[dict], spec: dict, side: JobSide, account: dict, reports: list[dict],
                ends: list[dict], requeued: bool) -> dict[str, tp.Any]:
    """The stop line's node fields (``hpc.core.health``): the failed ranks' nodes, whether the failure is
    theirs, and after a granted requeue the nodes the next start excludes (set anew each time, so that a
    node whose window has passed comes back), or why they could not be."""
    nodes = health.failed_nodes(account.get("failed_ranks", []), reports, ends)
    out: dict[str, tp.Any] = {"failed_nodes": nodes, "node_fault": bool(nodes) and health.node_fault(account, reports)}
    for cause in ("hang", "preflight"):  # the watchdog's verdict (trainer.watchdog), the pre-flight check's
        found = next((r[cause] for r in reports if r.get(cause) and r.get("rank") in account.get("failed_ranks", [])),
                     None)
        if found:
            out[cause] = found
    if not requeued:
        return out
    settings = health.health_of(spec)
    found = [*health.faults(ledger, settings.exclude_stragglers), *((n, time.time()) for n in nodes if out["node_fault"])]
    if settings.exclude_stragglers:  # this start's stragglers (``exclude_stragglers``): their nodes too
        found += [(str(s["host"]), time.time()) for s in account.get("stragglers", []) if s.get("host")]
    return {**out, **health.exclude(ledger, found, time.time(), settings, side)}


def _loading_failure(side: JobSide, run_dir: Path) -> dict[str, str] | None:
    """A start that wrote no start line and whose ranks reported nothing: did python fail to load the
    job's code (submitit unpickling the task, an import, ``python -m trainer.entry`` itself)? Read from
    task 0's stderr in this start's part of the batch log, not from submitit's result pickle: the log
    is marked per start (the pickle is overwritten by each start, and stale when one died without
    writing it), it also holds what python says when it cannot start the task module at all (no pickle
    then), and reading text runs nothing from the run folder."""
    try:
        return failures.loading_failure(side.start_log(run_dir))
    except (OSError, ValueError):
        return None


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


def _failed_step(rd: RunDir, ledger: list[dict], mine: int | None, reports: list[dict]) -> int:
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
