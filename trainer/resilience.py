"""Checkpoints at step boundaries, preemption, cancel, requeue and the goodput ledger.

The loop calls two seams (``train.resume`` once, ``loop.step_boundary`` after every optimizer
step); both delegate here when ``run_rank`` attached a ``Resilience`` to the trainer.

- Resume: rank 0 picks the newest committed checkpoint and broadcasts its step; every rank loads it
  (model, optimizer, scheduler, train state, its own RNG states). Rank 0 writes the ledger's start
  line and records RUNNING (and a requeue the scheduler made on its own) in ``states.jsonl``.
- Step boundary: the ranks agree on ``[preemption flag, SIGTERM seen, rank 0's "minutes elapsed"]``
  through a ``BoundaryVote`` (a MAX all-reduce on a gloo side group, sent at one boundary and read at
  the next: no GPU sync; a signal is acted on at most one step later). Then, on every rank alike: after
  SIGTERM (a cancel), stop without saving; else save every ``interval_steps`` / ``interval_minutes``,
  at the last step (unless this step is already saved), and when preemption was agreed, after which
  the loop stops. After the first step the collective timeout is shortened (``CollectiveTimeouts``;
  saves keep the long one).
- Stop (after the process group is down): rank 0 writes the ledger's stop line and, after a
  preemption, takes the incarnation's one requeue (``hpc.core.requeue``): ``scontrol requeue`` on Slurm,
  exit status 144 under submitit's local controller, nothing under torchrun or one process (run the
  same command again to resume).
- Failure: every rank that failed on its own (not as the echo of another's SIGTERM) reports it in
  ``RUN/requeue/``. Where the batch script's check after srun decides (Slurm), that is all: it writes
  the stop line and requeues. Elsewhere rank 0 records the failure and requeues unless the previous
  stop was a failure at the same step (no progress), the budget is spent, or SIGTERM was seen.

``RUN/ledger.jsonl``: one ``start`` and one ``stop`` line per incarnation of the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import typing as tp
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from hpc.core import requeue as policy_
from hpc.core import runs, straggler
from hpc.core.failures import (code_roots, first_failure_account, one_line, record_saves, repeat_reason,
                               user_code_error, would_repeat)
from hpc import schedulers
from hpc.core.container import inside_record
from hpc.core.procs import process_start_time
from hpc.schedulers.base import JobSide, wait_since_last_stop
from hpc.core.health import Health
from hpc.core.spec import Checkpoint
from trainer.boundary import LoopView, P, Progress
from trainer.checkpoint import Checkpointer, committed_steps, latest_checkpoint, step_dir
from trainer.dist import CollectiveTimeouts
from trainer.preemption import BoundaryVote, PreemptionFlag
from trainer.watch import write_best
from trainer.watchdog import Watchdog, paused

if tp.TYPE_CHECKING:  # pragma: no cover
    from trainer.run import Run

log = logging.getLogger("hpcx.trainer")
SIGTERM_NOT_REQUEUED = "the job got SIGTERM (cancelled or ending): a cancel is not a preemption"
LIMIT_REACHED = "the time limit ended the tasks before a step boundary after its signal (nothing saved then)"
LIMIT_REACHED_S = 5.0  # a SIGINT this close to the time limit (or past it) is the limit's
TIME_LIMIT_SLACK_S = 30  # beyond the lead and how early the scheduler may send it (JobSide.signal_early_s)


@dataclass
class Resilience:
    """One rank's checkpoint/preemption state; rank 0 also keeps the ledger and requeues. The loop's
    ``trainer.boundary.StepBoundary``."""

    run_dir: Path
    policy: Checkpoint
    max_requeues: int
    seed: int
    rank: int
    preemption: PreemptionFlag | None = None
    side: JobSide | None = None  # the scheduler that started this job (None: nobody can requeue it)
    timeouts: CollectiveTimeouts | None = None
    step: int = 0  # the last completed step (what a failure is reported at)
    restart: int = 0  # earlier starts in the ledger (this incarnation's number)
    last_saved_step: int | None = None
    last_save_clock: float = field(default_factory=time.monotonic)  # rank 0's clock decides
    save_s: float = 0.0
    saves: int = 0
    reason: str | None = None  # completed | preempted | terminated, once the loop has stopped
    signal_lead_s: int = 0  # how long before the time limit the scheduler sends the preemption signal
    phase: str = "load"  # where this rank is (hpc.core.failures.PHASES): a failure's report says it
    vote: BoundaryVote = field(default_factory=BoundaryVote)
    boundaries: int = 0  # step boundaries seen by this incarnation
    code_modules: tuple[str, ...] = ()  # the job's own modules (task.target's, a user model's): user errors
    notes: dict[str, tp.Any] = field(default_factory=dict)  # for the start line (``data_resume``)
    checkpointer: Checkpointer = field(init=False, repr=False)  # this run folder's saves (and the one in flight)
    watchdog: Watchdog | None = None  # the hang watchdog (trainer.watchdog): suspended while saving
    health: Health = field(default_factory=Health)  # the spec's [health]: exclude_stragglers on a granted requeue

    def __post_init__(self) -> None:
        self.checkpointer = Checkpointer(self.run_dir, keep=self.policy.keep, async_save=self.policy.async_save)

    # ------------------------------------------------------------ resume

    def resume(self, t: LoopView, state: P) -> P:
        """Load the newest committed checkpoint into ``t`` and ``state`` (collective); write the start line."""
        tic = time.perf_counter()
        path = self._agreed_start(t.device)
        if path is not None:
            loaded = self.checkpointer.load(path, t.model, t.optimizer, t.scheduler)
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
            line = {**start_line(self.run_dir, state.step, self.restart, path, time.perf_counter() - tic, self.side),
                    **self.notes}
            runs.append_jsonl(runs.RunDir(self.run_dir).ledger, line)
            policy_.record_start(self.run_dir, self.side)
        self.last_save_clock = time.monotonic()
        return state

    def _agreed_start(self, device: torch.device) -> Path | None:
        """Rank 0's choice of the newest committed checkpoint (when ``checkpoint.resume``) and this
        incarnation's number (the ledger's earlier starts), broadcast together."""
        path, restart = None, 0
        if self.rank == 0:
            path = latest_checkpoint(self.run_dir) if self.policy.resume else None
            if self.policy.resume:
                set_aside_untrusted(self.run_dir, path)
            restart = policy_.start_number(runs.RunDir(self.run_dir).read_ledger(), self.side)
        chosen = torch.tensor([-1 if path is None else int(path.name.split("-")[1]), restart], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(chosen, src=0)
        step, self.restart = (int(v) for v in chosen.tolist())
        return None if step < 0 else step_dir(self.run_dir, step)

    # ------------------------------------------------------------ step boundary

    def boundary(self, t: LoopView, state: Progress) -> bool:
        """Save when due; True when the loop must stop (preemption or SIGTERM agreed). Collective."""
        self.step = state.step
        self.boundaries += 1
        if self.boundaries == 1 and self.timeouts is not None:
            self.timeouts.shorten(t.model)
        early = t.watch is not None and t.watch.stopped_at == state.step
        final = state.step >= t.steps or early
        preempted, terminated, minutes_due = self._votes(last=final)
        if terminated:
            self.vote.close()
            self.reason = "terminated"
            log.warning("SIGTERM agreed at step %d: stopping without saving (a cancel)", state.step)
            return True
        every = self.policy.interval_steps
        best = t.watch is not None and t.watch.keep_best and t.watch.improved_at == state.step
        due = final or preempted or minutes_due or best or bool(every and state.step % every == 0)
        if t.watch is not None:
            self.checkpointer.protected = t.watch.protected()
        if due and self.last_saved_step != state.step:
            self._save(t, state)
        if best and self.rank == 0:
            assert t.watch is not None
            write_best(self.run_dir, t.watch)
        if final or preempted:
            self.vote.close()
            self._timed(self.checkpointer.wait)  # the stop save must be committed before anyone leaves
            self.checkpointer.close()  # no save follows the stop save
            self.reason = "completed" if final else "preempted"
        if preempted and not final:
            log.warning("preemption agreed at step %d: saved, stopping", state.step)
            return True
        if early and t.watch is not None:
            log.warning("early stop at step %d: %s did not improve for %d evaluations (best %s at step %s)",
                        state.step, t.watch.metric, t.watch.since, t.watch.best, t.watch.best_step)
        return early

    def _votes(self, last: bool = False) -> tuple[bool, bool, bool]:
        """(preemption requested on any rank, SIGTERM seen on any rank, rank 0's clock says a
        minutes-interval save is due), as agreed at this boundary (``BoundaryVote``)."""
        minutes = self.policy.interval_minutes
        flags = self.preemption.mine() if self.preemption is not None else [0, 0]
        due = self.rank == 0 and bool(minutes) and time.monotonic() - self.last_save_clock >= 60 * minutes
        preempted, terminated, minutes_due = self.vote.exchange([*flags, int(due)], last=last)
        return bool(preempted), bool(terminated), bool(minutes_due)

    def _save(self, t: LoopView, state: Progress) -> None:
        self._timed(lambda: self.checkpointer.save(state.step, t.model, t.optimizer, t.scheduler,
                                                   state.state_dict(), dims=t.dims))
        self.saves += 1
        self.last_saved_step = state.step
        self.last_save_clock = time.monotonic()
        self._record_saves(state.step)

    def _record_saves(self, step: int) -> None:
        """Rank 0: this start's saves so far, in the run folder (the check after srun counts them)."""
        if self.rank != 0 or self.side is None:
            return
        try:
            record_saves(self.run_dir, self.incarnation, self.saves, self.save_s, step)
        except OSError as exc:
            log.warning("could not record the saves of this start: %s", exc)

    def _timed(self, work: tp.Callable[[], tp.Any]) -> None:
        tic = time.perf_counter()
        with self.timeouts.lengthened() if self.timeouts is not None else contextlib.nullcontext(), \
                paused(self.watchdog):
            work()
        self.save_s += time.perf_counter() - tic

    # ------------------------------------------------------------ stop and failure

    def stopped(self) -> None:
        """After the loop and the process-group teardown: rank 0 records the stop and, after a
        preemption or the time-limit signal, requeues (may end the process with submitit's local requeue
        status). A preempted job that cannot be requeued raises RuntimeError, so that it does not look
        completed; at the time limit without a requeue left the job is held until the limit ends it."""
        if self.rank != 0:
            return
        reason = self.reason or "completed"
        if reason == "preempted" and self._at_time_limit():
            reason = "time_limit"
        why_not = {"preempted": self._requeue, "time_limit": lambda: self._requeue(reason="time_limit"),
                   "terminated": lambda: SIGTERM_NOT_REQUEUED}.get(reason, lambda: None)()
        granted = why_not is None and reason in ("preempted", "time_limit")
        self._record_stop(reason, why_not, **(self._exclude_stragglers() if granted else {}))
        if reason not in ("preempted", "time_limit"):
            return
        if why_not is None:
            self._leave_for_requeue()
        elif reason == "time_limit" and self.side is not None:
            self.side.await_time_limit()
        elif self.side is not None:  # a scheduler's job that stops unfinished must not look completed
            raise RuntimeError(f"preempted at step {self.step} (checkpoint saved) and not requeued: {why_not}")

    def _at_time_limit(self) -> bool:
        """Whether the preemption signal was the scheduler's warning of the time limit: it came at most
        the signal lead (plus how early the scheduler may send it, ``JobSide.signal_early_s``: Slurm's
        60 s, none for the local controller; and 30 s of slack) before this incarnation's end."""
        left = self.side.seconds_left() if self.side is not None else None
        if left is None or self.side is None:
            return False
        since = time.time() - (self.preemption.requested_at if self.preemption and self.preemption.requested_at
                               else time.time())
        return left + since <= self.signal_lead_s + self.side.signal_early_s + TIME_LIMIT_SLACK_S

    def _limit_reached(self) -> bool:
        """Whether this start's time limit has come (a scheduler that ends the tasks with SIGINT there:
        submitit's local controller, when no step boundary came between its signal and the limit)."""
        left = self.side.seconds_left() if self.side is not None else None
        return left is not None and left <= LIMIT_REACHED_S

    def failed(self, exc: BaseException) -> None:
        """From the exception handler of ``run_rank``, on every rank: report the failure (unless it is
        the echo of a SIGTERM that ended the step); then, where no check after srun decides, rank 0
        records it and requeues unless this is a cancel, the budget is spent, or there was no progress."""
        terminated = self.preemption is not None and self.preemption.terminated
        where = None if terminated else user_code_error(exc, code_roots(self.code_modules))
        error = one_line(exc, where)
        repeats = not terminated and (where is not None or would_repeat(exc, self.phase, self.boundaries))
        if (self.rank == 0 or not terminated) and not getattr(exc, "reported", False):  # a pre-flight check's are out
            self._report(error, terminated, repeats, user_code=where)
        if self.rank != 0 or (self.side is not None and self.side.decides_failures):
            return
        try:
            reason = "terminated" if terminated else "failed"
            why_not: str | None
            if isinstance(exc, KeyboardInterrupt) and self._limit_reached():
                reason, why_not = "time_limit", LIMIT_REACHED
            elif not isinstance(exc, Exception):  # KeyboardInterrupt (Ctrl-C), SystemExit
                why_not = f"{type(exc).__name__} is a cancel or an exit, not a failure"
            else:
                why_not = self._repeating() or self._requeue(reason="failed")
            account = self._first_failure(terminated)
            if getattr(exc, "reported", False):  # a failed pre-flight check: its record, as the check after srun keeps
                account.update(node_fault=True, preflight=getattr(exc, "verdict", {}))
            self._record_stop(reason, why_not, error=account.pop("error", error), **account)
        except Exception:  # never mask the original failure
            log.exception("could not record the failure in %s", runs.RunDir.LEDGER)
            return
        if why_not is None:
            self._leave_for_requeue()

    def _first_failure(self, terminated: bool) -> dict[str, tp.Any]:
        """Rank 0 deciding (no check after srun): the rank that failed first on its own, from the ranks'
        reports (in the order they were written) and the scheduler's account of the tasks that are gone,
        not rank 0 itself when it only lost its connection to that rank (``first_failure_account``)."""
        if terminated or self.side is None:
            return {}
        try:
            reports = policy_.failure_reports(self.run_dir, self.incarnation)
            return first_failure_account(reports, self.side.task_ends(self.run_dir))
        except (OSError, ValueError, runs.ConfigError) as exc:
            log.warning("could not read the ranks' failure reports: %s", exc)
            return {}

    def _report(self, error: str, terminated: bool, repeats: bool = False, user_code: str | None = None) -> None:
        """This rank's failure report for whoever writes the stop line (``hpc.core.requeue``): where it
        failed (``phase``) and whether a restart would fail the same way (``repeats``)."""
        if self.side is None:
            return
        try:
            policy_.report_failure(self.run_dir, self.incarnation, self.rank, step=self.step,
                                   error=error.splitlines()[0][:300] if error else "", terminated=terminated,
                                   host=os.uname().nodename, save_s=round(self.save_s, 3), saves=self.saves,
                                   phase=self.phase, repeats=repeats,
                                   **({"user_code": user_code} if user_code else {}))
        except OSError as exc:
            log.warning("could not write the failure report: %s", exc)

    def _repeating(self) -> str | None:
        """Why not to requeue when this or another rank failed in a way a restart repeats, else None."""
        if self.side is None:
            return None
        reports = policy_.failure_reports(self.run_dir, self.incarnation)
        repeating = [r for r in reports if r.get("repeats")]
        return repeat_reason(repeating[0]) if repeating else None

    def _requeue(self, reason: str = "preempted") -> str | None:
        """Ask for this incarnation's one requeue; None when granted, else why not."""
        if self.preemption is not None and self.preemption.terminated:
            return SIGTERM_NOT_REQUEUED
        if not self.policy.resume:
            return "checkpoint.resume = false: a restart would start over"
        return policy_.ask(self.side, self.run_dir, self.incarnation, reason, self.step, self.max_requeues)

    @property
    def incarnation(self) -> str:
        """This start's name (``JobSide.incarnation``; ``run.N`` without a scheduler)."""
        return self.side.incarnation(self.restart) if self.side is not None else f"run.{self.restart}"

    def _stragglers(self) -> list[dict]:
        """The ranks the straggler report named during this start (``trainer.straggler``)."""
        return straggler.of_start(self.run_dir, self.incarnation)

    def _exclude_stragglers(self) -> dict[str, tp.Any]:
        """After a granted requeue, ``health.exclude_stragglers``: their nodes join the excluded ones."""
        if self.side is None or not self.health.exclude_stragglers:
            return {}
        ledger = runs.RunDir(self.run_dir).read_ledger()
        return straggler.exclusion_after_requeue(ledger, self._stragglers(), self.health, self.side, time.time())

    def _record_stop(self, reason: str, why_not: str | None, error: str | None = None, **account: tp.Any) -> None:
        extra: dict[str, tp.Any] = {"error": error.splitlines()[0][:300] if error else ""} if error is not None else {}
        if named := self._stragglers():  # ranks named slow during this start
            extra["stragglers"] = named
        line = policy_.stop_line(self.step, reason, why_not, self.side, "rank 0", save_s=round(self.save_s, 3),
                                 saves=self.saves, **extra, **account)
        if line.get("not_requeued") and reason not in ("completed", "terminated"):
            log.warning("not requeued: %s", why_not)
        runs.append_jsonl(runs.RunDir(self.run_dir).ledger, line)

    def _leave_for_requeue(self) -> None:
        if self.side is not None:
            self.side.leave_for_requeue()


def resilience_for(run: Run, rank: int, preemption: PreemptionFlag | None) -> Resilience:
    """The ``Resilience`` of one rank of ``run``."""
    parallel = run.spec.parallel
    return Resilience(run_dir=run.run_dir, policy=run.spec.checkpoint, max_requeues=run.spec.job.max_requeues,
                      seed=run.spec.train.seed, rank=rank, preemption=preemption, side=schedulers.job_side(),
                      timeouts=CollectiveTimeouts(parallel.timeout_s, parallel.step_timeout_s),
                      signal_lead_s=run.launch.signal_lead_s, code_modules=code_modules(run.spec),
                      health=run.spec.health)


def code_modules(spec: tp.Any) -> tuple[str, ...]:
    """The job's own modules: ``task.target``'s or a user model's (``model.arch = "pkg.mod:build"``)."""
    return spec.workload.code_modules


def report_unloadable(run_dir: Path, rank: int, exc: Exception) -> None:
    """A rank that cannot read its run folder (``resolved.json`` torn, or of a spec this trainer refuses)
    reports it, phase "load", for whoever writes the stop line; such a failure repeats on a restart."""
    side = schedulers.job_side()
    if side is None:
        return
    try:
        restart = policy_.start_number(runs.RunDir(run_dir).read_ledger(), side, own_line_written=True)
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        policy_.report_failure(run_dir, side.incarnation(restart), rank, step=0, error=error, terminated=False,
                               host=os.uname().nodename, save_s=0.0, saves=0, phase="load",
                               repeats=would_repeat(exc, "load", 0))
    except (OSError, runs.ConfigError) as err:
        log.warning("could not write the failure report: %s", err)


# ---------------------------------------------------------------- pure decisions and records


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


def start_line(run_dir: Path, step: int, restart: int, checkpoint: Path | None, restore_s: float,
               side: JobSide | None) -> dict:
    """The ledger's line for start number ``restart`` (rank 0, which decided it: ``_agreed_start``):
    ``hpc.core.requeue.start_line`` with what the trainer adds (the checkpoint it resumed from, the steps it
    recomputes, restore and start-up times, the image)."""
    rd = runs.RunDir(run_dir)
    ledger, last = rd.read_ledger(), rd.last_metrics() or {}
    wait = side.queue_wait(run_dir, ledger) if side is not None else wait_since_last_stop(run_dir, ledger)
    return policy_.start_line(
        step, restart, side, "trainer", wait,
        checkpoint=checkpoint.name if checkpoint else None,
        steps_recomputed=steps_recomputed(ledger, last.get("step"), step), restore_s=round(restore_s, 3),
        startup_s=round(time.time() - process_start_time(), 3), **inside_record(os.environ))


def set_aside_untrusted(run_dir: Path, chosen: Path | None) -> None:
    """Rename committed-looking folders newer than ``chosen`` (``latest_checkpoint`` refused them:
    torn) to ``.step-N.torn``, so that saving that step again is possible (the next save removes them)."""
    newest = -1 if chosen is None else int(chosen.name.split("-")[1])
    for step, path in committed_steps(run_dir):
        if step > newest:
            log.warning("checkpoint %s is incomplete: set aside as .%s.torn", path, path.name)
            os.rename(path, path.parent / f".{path.name}.torn")

