"""Checkpoints at step boundaries, preemption, requeue and the goodput ledger.

The loop calls two seams (``train.resume`` once, ``loop.step_boundary`` after every optimizer
step); both delegate here when ``run_rank`` attached a ``Resilience`` to the trainer.

- Resume: rank 0 picks the newest committed checkpoint and broadcasts its step; every rank loads it
  (model, optimizer, scheduler, train state, its own RNG states).
- Step boundary: one all-reduce (MAX) of ``[preemption flag, rank 0's "minutes elapsed" vote]``, so
  every rank takes the same decision from rank 0's clock. Then, on every rank alike: save every
  ``interval_steps`` / ``interval_minutes``, at the last step (unless this step is already saved),
  and when preemption was agreed, after which the loop stops.
- Stop (after the process group is down): rank 0 writes the ledger's stop line and, after a
  preemption, requeues exactly once: ``scontrol requeue $SLURM_JOB_ID`` on Slurm, exit status 144
  (``LOCAL_REQUEUE_EXIT``) under submitit's local controller, nothing under torchrun or one process
  (run the same command again to resume).
- Failure: rank 0 records it and requeues once more unless the previous stop was a failure at the
  same step (no progress), the requeue budget is spent, or the job is being cancelled (SIGTERM was
  seen: the stop is then recorded as ``terminated``; or Slurm no longer says RUNNING).

``RUN/ledger.jsonl`` (rank 0): one ``start`` and one ``stop`` line per incarnation of the job.
"""

from __future__ import annotations

import datetime
import logging
import os
import subprocess
import sys
import time
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hpc import compat, runs
from hpc.spec import Checkpoint
from trainer.checkpoint import (committed_steps, latest_checkpoint, load_checkpoint, save_checkpoint, step_dir,
                                wait_pending)
from trainer.preemption import PreemptionFlag

log = logging.getLogger("hpcx.trainer")

LEDGER = "ledger.jsonl"
LOCAL_REQUEUE_EXIT = compat.local_requeue_exit_code()  # submitit's local controller restarts the tasks


def scheduler_kind() -> str:
    """Who can requeue this process: ``slurm``, ``local`` (submitit's controller) or ``""`` (nobody)."""
    executor = os.environ.get("SUBMITIT_EXECUTOR", "")
    if executor == "slurm" and os.environ.get("SLURM_JOB_ID"):
        return "slurm"
    return "local" if executor == "local" else ""


@dataclass
class Resilience:
    """One rank's checkpoint/preemption state; rank 0 also keeps the ledger and requeues."""

    run_dir: Path
    policy: Checkpoint
    max_requeues: int
    seed: int
    rank: int
    preemption: PreemptionFlag | None = None
    scheduler: str = ""
    step: int = 0  # the last completed step (what a failure is reported at)
    last_saved_step: int | None = None
    last_save_clock: float = field(default_factory=time.monotonic)  # rank 0's clock decides
    save_s: float = 0.0
    saves: int = 0
    reason: str | None = None  # completed | preempted, once the loop has stopped

    # ------------------------------------------------------------ resume

    def resume(self, t: tp.Any, state: tp.Any) -> tp.Any:
        """Load the newest committed checkpoint into ``t`` and ``state`` (collective); write the start line."""
        tic = time.perf_counter()
        path = self._agreed_checkpoint(t.device) if self.policy.resume else None
        if path is not None:
            loaded = load_checkpoint(path, t.model, t.optimizer, t.scheduler)
            state.load_state_dict(loaded)
            self.last_saved_step = state.step
            if not loaded["rng_restored"]:  # another world size: no saved RNG state for this rank
                torch.manual_seed(self.seed + self.rank + 1_000_003 * state.step)
                log.warning("rank %d: no RNG state in %s (world size changed?): reseeded; dropout will differ "
                            "from an uninterrupted run", self.rank, path.name)
            log.info("resumed from %s at step %d", path, state.step)
        elif not self.policy.resume and committed_steps(self.run_dir):
            log.warning("checkpoint.resume = false: starting over although %s holds checkpoints", self.run_dir)
        self.step = state.step
        if self.rank == 0:
            runs.append_jsonl(self.run_dir / LEDGER, start_line(self.run_dir, state.step, path,
                                                                time.perf_counter() - tic, self.scheduler))
        self.last_save_clock = time.monotonic()
        return state

    def _agreed_checkpoint(self, device: torch.device) -> Path | None:
        """Rank 0's choice of the newest committed checkpoint, broadcast as a step number."""
        path = latest_checkpoint(self.run_dir) if self.rank == 0 else None
        if self.rank == 0:
            set_aside_untrusted(self.run_dir, path)
        chosen = torch.tensor([-1 if path is None else int(path.name.split("-")[1])], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(chosen, src=0)
        step = int(chosen.item())
        return None if step < 0 else step_dir(self.run_dir, step)

    # ------------------------------------------------------------ step boundary

    def boundary(self, t: tp.Any, state: tp.Any) -> bool:
        """Save when due; True when the loop must stop (preemption agreed). Collective."""
        self.step = state.step
        preempted, minutes_due = self._votes(t.device)
        final = state.step >= t.steps
        every = self.policy.interval_steps
        due = final or preempted or minutes_due or bool(every and state.step % every == 0)
        if due and self.last_saved_step != state.step:
            self._save(t, state)
        if final or preempted:
            self._timed(wait_pending)  # the stop save must be committed before anyone leaves
            self.reason = "completed" if final else "preempted"
        if preempted and not final:
            log.warning("preemption agreed at step %d: saved, stopping", state.step)
            return True
        return False

    def _votes(self, device: torch.device) -> tuple[bool, bool]:
        """(preemption requested on any rank, rank 0's clock says a minutes-interval save is due)."""
        minutes = self.policy.interval_minutes
        if self.preemption is None and not minutes:
            return False, False
        mine = [bool(self.preemption and self.preemption.requested),
                self.rank == 0 and bool(minutes) and time.monotonic() - self.last_save_clock >= 60 * minutes]
        votes = torch.tensor([int(v) for v in mine], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(votes, op=dist.ReduceOp.MAX)
        return bool(votes[0].item()), bool(votes[1].item())

    def _save(self, t: tp.Any, state: tp.Any) -> None:
        self._timed(lambda: save_checkpoint(self.run_dir, state.step, t.model, t.optimizer, t.scheduler,
                                            state.state_dict(), keep=self.policy.keep,
                                            async_save=self.policy.async_save, strategy=t.strategy))
        self.saves += 1
        self.last_saved_step = state.step
        self.last_save_clock = time.monotonic()

    def _timed(self, work: tp.Callable[[], tp.Any]) -> None:
        tic = time.perf_counter()
        work()
        self.save_s += time.perf_counter() - tic

    # ------------------------------------------------------------ stop and failure

    def stopped(self) -> None:
        """After the loop and the process-group teardown: rank 0 records the stop and, after a
        preemption, requeues (may end the process with ``LOCAL_REQUEUE_EXIT``). Raises RuntimeError
        when a preempted job cannot be requeued, so that it does not look completed."""
        if self.rank != 0:
            return
        reason = self.reason or "completed"
        why_not = self._requeue() if reason == "preempted" else None
        self._record_stop(reason, why_not)
        if reason != "preempted":
            return
        if why_not is None:
            self._leave_for_local_requeue()
        elif self.scheduler:  # a scheduler's job that stops unfinished must not look completed
            raise RuntimeError(f"preempted at step {self.step} (checkpoint saved) and not requeued: {why_not}")

    def failed(self, exc: BaseException) -> None:
        """On rank 0, from the exception handler of ``run_rank``: record the failure; requeue unless
        this is a cancel, the budget is spent, or the previous stop failed at the same step."""
        if self.rank != 0:
            return
        try:
            if not isinstance(exc, Exception):  # KeyboardInterrupt (a local cancel), SystemExit
                why_not = f"{type(exc).__name__} is a cancel or an exit, not a failure"
            else:
                why_not = self._requeue(reason="failed")
            terminated = self.preemption is not None and self.preemption.terminated
            self._record_stop("terminated" if terminated else "failed", why_not, error=f"{type(exc).__name__}: {exc}")
        except Exception:  # never mask the original failure
            log.exception("could not record the failure in %s", LEDGER)
            return
        if why_not is None:
            self._leave_for_local_requeue()

    def _requeue(self, reason: str = "preempted") -> str | None:
        """Ask for one requeue; None when granted, else why not."""
        if self.preemption is not None and self.preemption.terminated:
            return "the job got SIGTERM (cancelled or ending): a cancel is not a preemption"
        if not self.policy.resume:
            return "checkpoint.resume = false: a restart would start over"
        why_not = requeue_verdict(runs.read_jsonl(self.run_dir / LEDGER), reason, self.step, self.max_requeues)
        if why_not is not None:
            return why_not
        if self.scheduler == "slurm":
            return requeue_slurm(os.environ["SLURM_JOB_ID"])
        if self.scheduler == "local":
            return None  # granted: the process leaves with LOCAL_REQUEUE_EXIT after the stop line
        return "no scheduler to requeue (torchrun or one process): run the same command again to resume"

    def _record_stop(self, reason: str, why_not: str | None, error: str | None = None) -> None:
        line = {"event": "stop", "time": time.time(), "step": self.step, "reason": reason,
                "save_s": round(self.save_s, 3), "saves": self.saves,
                "requeued": why_not is None and reason != "completed", "job_id": job_id()}
        if why_not is not None and reason != "completed":
            line["not_requeued"] = why_not
            log.warning("not requeued: %s", why_not)
        if error is not None:
            line["error"] = error.splitlines()[0][:300] if error else ""
        runs.append_jsonl(self.run_dir / LEDGER, line)

    def _leave_for_local_requeue(self) -> None:
        if self.scheduler != "local":
            return
        log.warning("requeue: leaving with exit status %d; submitit's local controller restarts the tasks",
                    LOCAL_REQUEUE_EXIT)
        for handler in log.handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(LOCAL_REQUEUE_EXIT)


def resilience_for(run: tp.Any, rank: int, preemption: PreemptionFlag | None) -> Resilience:
    """The ``Resilience`` of one rank of ``run`` (a ``trainer.run.Run``)."""
    return Resilience(run_dir=run.run_dir, policy=run.spec.checkpoint, max_requeues=run.spec.job.max_requeues,
                      seed=run.spec.train.seed, rank=rank, preemption=preemption, scheduler=scheduler_kind())


# ---------------------------------------------------------------- pure decisions


def requeue_verdict(ledger: list[dict], reason: str, step: int, max_requeues: int) -> str | None:
    """None when one more requeue is allowed, else why not (``ledger`` as read before this stop's line).

    Restarts are counted from the ledger's start lines (the first start is not a restart). A failure at
    the same step as the previous stop's failure made no progress and is not requeued again.
    """
    restarts = max(0, sum(1 for e in ledger if e.get("event") == "start") - 1)
    if restarts >= max_requeues:
        return f"job.max_requeues = {max_requeues} reached ({restarts} restarts so far)"
    stops = [e for e in ledger if e.get("event") == "stop"]
    if reason == "failed" and stops and stops[-1].get("reason") == "failed" and stops[-1].get("step") == step:
        return f"failed twice at step {step} without progress"
    return None


def steps_recomputed(ledger: list[dict], metrics_last_step: int | None, resumed_step: int) -> int:
    """Steps the previous incarnation had done beyond the checkpoint this one resumes from.

    Its last step is its stop line's, or, when it left none (killed), the last step in metrics.jsonl.
    """
    if not any(e.get("event") == "start" for e in ledger):
        return 0
    last = ledger[-1]
    reached = last.get("step") if last.get("event") == "stop" else metrics_last_step
    if reached is None:
        reached = last.get("step", resumed_step)
    return max(0, int(reached) - resumed_step)


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol -o show job`` output as a dict (values without spaces are enough here)."""
    return dict(tok.split("=", 1) for tok in text.split() if "=" in tok)


def scontrol_seconds(stamp: str) -> float | None:
    """``2026-11-29T18:37:30`` (the controller's local time) as epoch seconds; None for Unknown/None."""
    try:
        return datetime.datetime.fromisoformat(stamp).timestamp()
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------- scheduler edge


def job_id() -> str | None:
    return os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID")


def show_job(job: str) -> dict[str, str]:
    """``scontrol -o show job JOB`` as a dict; empty when it fails."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_scontrol(out.stdout) if out.returncode == 0 else {}


def requeue_slurm(job: str) -> str | None:
    """``scontrol requeue JOB`` if this incarnation of the job is still the running one; None when done.

    A job that is not RUNNING is being cancelled, timed out or already requeued (by Slurm on a node
    failure, say); a restart count different from ours means another incarnation: never requeue then.
    """
    fields = show_job(job)
    state = fields.get("JobState", "UNKNOWN")
    if state != "RUNNING":
        return f"job {job} is {state}, not RUNNING (cancelled, ending or already requeued)"
    ours = os.environ.get("SLURM_RESTART_COUNT", "0")
    if fields.get("Restarts", "0") != ours:
        return f"job {job} was already restarted (Restarts={fields.get('Restarts')}, this run is {ours})"
    try:
        out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job} failed: {exc}"
    if out.returncode != 0:
        return f"scontrol requeue {job} failed: {out.stderr.strip() or out.returncode}"
    log.warning("requeued job %s (scontrol requeue)", job)
    return None


def queue_wait(run_dir: Path, ledger: list[dict], scheduler: str) -> tuple[float | None, str]:
    """(seconds this incarnation waited in the queue, where that came from).

    Slurm: ``StartTime - SubmitTime`` of ``scontrol show job`` (Slurm resets SubmitTime on a requeue).
    Elsewhere: this process's start minus the previous stop (after a requeue) or ``job.json``'s
    ``submitted_at`` (first start).
    """
    if scheduler == "slurm":
        fields = show_job(os.environ["SLURM_JOB_ID"])
        start, submit = scontrol_seconds(fields.get("StartTime", "")), scontrol_seconds(fields.get("SubmitTime", ""))
        if start is not None and submit is not None:
            return max(0.0, start - submit), "scontrol"
    if ledger and ledger[-1].get("event") == "stop":
        reference, source = ledger[-1].get("time"), "ledger"
    else:
        reference, source = runs.read_json(run_dir / "job.json").get("submitted_at"), "job.json"
    if reference is None or ledger and ledger[-1].get("event") == "start":  # the last run died silently
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


def start_line(run_dir: Path, step: int, checkpoint: Path | None, restore_s: float, scheduler: str) -> dict:
    """The ledger's line for this start (rank 0)."""
    ledger = runs.read_jsonl(run_dir / LEDGER)
    metrics = runs.read_jsonl(run_dir / "metrics.jsonl")
    wait, source = queue_wait(run_dir, ledger, scheduler)
    return {"event": "start", "time": time.time(), "restart": sum(1 for e in ledger if e.get("event") == "start"),
            "step": step, "checkpoint": checkpoint.name if checkpoint else None,
            "steps_recomputed": steps_recomputed(ledger, metrics[-1].get("step") if metrics else None, step),
            "restore_s": round(restore_s, 3), "queue_wait_s": None if wait is None else round(wait, 3),
            "queue_wait_source": source, "startup_s": round(time.time() - process_start_time(), 3),
            "job_id": job_id(), "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}


def set_aside_untrusted(run_dir: Path, chosen: Path | None) -> None:
    """Rename committed-looking folders newer than ``chosen`` (``latest_checkpoint`` refused them:
    torn) to ``.step-N.torn``, so that saving that step again is possible (the next save removes them)."""
    newest = -1 if chosen is None else int(chosen.name.split("-")[1])
    for step, path in committed_steps(run_dir):
        if step > newest:
            log.warning("checkpoint %s is incomplete: set aside as .%s.torn", path, path.name)
            os.rename(path, path.parent / f".{path.name}.torn")

