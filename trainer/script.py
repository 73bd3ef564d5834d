"""``ScriptTask``: script mode (``[job] command``), one rank of a user's own training command. Torch-free.

``hpcx submit`` pickles ``ScriptTask(run_dir, workdir)`` instead of ``TrainTask``; submitit runs it once
per rank, exactly where the trainer would run (``hpc.schedulers.base.task_command``, inside the site's
container when it has one). Each rank starts the command as a child process:

- with torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``), the site's NCCL/GLOO variables and ``env.set`` (as the trainer applies them),
  ``OMP_NUM_THREADS`` set to the task's CPUs where the site has no GPUs, and ``hpc.job``'s variables;
  every GPU the task was given stays visible (a rank drives ``cuda:LOCAL_RANK``, as under torchrun);
- in the folder ``hpcx submit`` ran in; ``python``/``python3`` as the first word is this task's interpreter;
- its stdout and stderr are the task's (submitit's per-rank logs under ``RUN/submitit/``);
- with the preemption signal ignored, so a script that does not listen is not killed by it.

Signals: the task holds USR2 and SIGTERM from its first line (``trainer.entry``); here the trainer's stop
request (``trainer.preemption.PreemptionFlag``) takes them, as in a trainer rank. USR2 (the scheduler's
warning, ``hpcx drill``) creates the flag file ``hpc.job.preempted`` reads and is forwarded to the command; SIGTERM (``hpcx cancel``, the end of the time limit) is forwarded and marks the
start terminated.

When the command has exited, rank 0 writes the ledger's stop line (``hpc.core.requeue``): completed;
``preempted`` and requeued when the script asked (``hpc.job.requeue``), else not requeued, saying why;
terminated (a cancel), or ``time_limit`` — unless the scheduler says SIGTERM came because another task
of the step failed (``JobSide.ended_by``: then the check after srun writes it); or failed with the exit
status. A failure is reported by every rank whose command failed
(``RUN/requeue/``); where the batch script's check after srun decides (Slurm) it takes the one requeue as
for the trainer, elsewhere rank 0 does (a script's own checkpoint is its progress: the ``step`` of its
``hpc.job.log`` lines).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import typing as tp
from pathlib import Path

from hpc import job, schedulers
from hpc.core import requeue as policy, runs
from hpc.core.runs import append_jsonl, read_json, read_jsonl, write_json
from hpc.core.workload import ScriptWorkload
from hpc.schedulers.base import wait_since_last_stop

if tp.TYPE_CHECKING:  # pragma: no cover
    from hpc.core.spec import JobSpec
from trainer.preemption import PreemptionFlag, preempt_signal
from trainer.ranks import detect_rank_env, rank_variables
from trainer.run import load_run

SCRIPT_NOT_ASKED = "the script did not ask for a requeue (hpc.job.requeue())"
TERMINATED = "the job got SIGTERM (cancelled or ending): a cancel is not a preemption"
TIME_LIMIT = "the time limit ended the command (a script that saves at hpc.job.preempted() and asks is requeued)"
PYTHONS = ("python", "python3")
RANKS_WAIT_S = 600.0  # how long rank 0 waits for a rank that never says how its command ended


class ScriptTask:
    """One rank of ``job.command`` for the run in ``run_dir``, started in ``workdir``."""

    def __init__(self, run_dir: str, workdir: str):
        self.run_dir = str(run_dir)
        self.workdir = str(workdir)

    def __call__(self) -> dict[str, tp.Any] | None:
        return ScriptRank(Path(self.run_dir), Path(self.workdir)).main()

    def checkpoint(self, *args: tp.Any, **kwargs: tp.Any) -> tp.Any:
        """submitit's requeue hook, reached only if the preemption signal came before ``run`` took the
        signals (the command had not started): the same task again."""
        import submitit  # lazy: submitit

        return submitit.helpers.DelayedSubmission(ScriptTask(self.run_dir, self.workdir))

    def __repr__(self) -> str:
        return f"ScriptTask({self.run_dir!r}, {self.workdir!r})"


def script_command(spec: JobSpec) -> tuple[str, ...]:
    """The run's ``job.command`` (its ``ScriptWorkload``); a run folder of hpcx's trainer is refused."""
    match spec.workload:
        case ScriptWorkload(command=command):
            return command
    raise ValueError(f"{spec.source}: the run trains with hpcx's trainer ({spec.workload.kind}), not a `job.command`")


def command_argv(command: tp.Sequence[str], python: str) -> list[str]:
    """``job.command`` as executed: a leading ``python``/``python3`` is this task's interpreter."""
    argv = list(command)
    if argv and argv[0] in PYTHONS:
        argv[0] = python
    return argv


def elastic_variables(restart: int, max_restarts: int, run_id: str, error_file: str) -> dict[str, str]:
    """The ``TORCHELASTIC_*`` variables torchrun's agent gives each worker (torch's
    ``LocalElasticAgent._start_workers`` and ``elastic.multiprocessing``): the restart count is this start's
    number (the requeues so far), the most restarts ``job.max_requeues``, the run id the job's; no agent
    store (the script's ``init_process_group`` starts its own on ``MASTER_PORT``, as under a plain launch);
    ``@record``'s error file in the run folder (``RUN/requeue/``)."""
    return {"TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": error_file}


TORCHRUN_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # torchrun's, where not already set


def child_env(base: tp.Mapping[str, str], ranks: dict[str, str], site_env: dict[str, str],
              env_set: dict[str, str], hpcx: dict[str, str], cpus_per_task: int, gpus: bool) -> dict[str, str]:
    """The command's environment: the task's, the site's NCCL/GLOO variables where not already set,
    ``env.set`` (explicit, so it overrides), the rank variables and ``hpc.job``'s (hpcx's, always), and
    ``OMP_NUM_THREADS`` = the task's CPUs on a CPU site when nobody set it. hpcx's own packages are
    appended to ``PYTHONPATH`` so ``from hpc import job`` imports where hpcx is not installed."""
    env = dict(base)
    for name, value in site_env.items():
        env.setdefault(name, value)
    env.update(env_set)
    env.update(ranks)
    env.update(hpcx)
    if not gpus:
        env.setdefault("OMP_NUM_THREADS", str(max(1, cpus_per_task)))
    root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([root] if root not in paths else []))
    return env


def exit_words(status: int) -> str:
    """``exited with status 3`` / ``killed by SIGKILL`` for a child's return code."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with status {status}"


class ScriptRank:
    """The command on this rank: start, signals, and the records of how it ended."""

    def __init__(self, run_dir: Path, workdir: Path, clock: tp.Callable[[], float] = time.time):
        self.run = load_run(run_dir)
        self.command = script_command(self.run.spec)
        self.rd = runs.RunDir(self.run.run_dir)
        self.workdir = workdir
        self.env = detect_rank_env()
        self.side = schedulers.job_side()
        self.clock = clock
        # the trainer's definition of a start's number; a rank other than 0 may read rank 0's line of this start
        self.restart = policy.start_number(self.rd.read_ledger(), self.side, own_line_written=not self.env.is_rank0)
        self.incarnation = self.side.incarnation(self.restart) if self.side else f"single.{self.restart}"
        self.requeue_dir = self.rd.requeue
        self.flag = self.requeue_dir / f"{self.incarnation}.preempted"
        self.asked = self.requeue_dir / f"{self.incarnation}.asked"
        # the stop request, as the trainer's: set by the signals, forwarded to the command
        self.stop = PreemptionFlag(clock, on_first_request=self._touch_flag, forward=self._forward)
        self.child: subprocess.Popen | None = None
        self.exited_at: float | None = None

    # ------------------------------------------------------------ the command

    def main(self) -> dict[str, tp.Any] | None:
        self.requeue_dir.mkdir(exist_ok=True)
        if self.env.is_rank0:
            self._record_start()
        # own the preemption signal and SIGTERM, then release what ``trainer.entry`` held (one that came before
        # the command started is acted on now: the flag is set before the command reads it)
        self.stop.install()
        status = self._run_command()
        self.exited_at = self.clock()  # when this rank's command ended: the first to fail is named
        return self._ended(status)

    def argv(self) -> list[str]:
        return command_argv(self.command, sys.executable)

    def environment(self) -> dict[str, str]:
        e, launch = self.env, self.run.launch
        ranks = rank_variables(e.rank, e.local_rank, e.world_size, e.local_world_size, e.master_addr, e.master_port)
        run_id = (self.side.job_id() if self.side else None) or self.run.run_dir.name
        ranks.update(elastic_variables(self.restart, self.run.spec.job.max_requeues, str(run_id),
                                       str(self.error_file(e.rank))))
        hpcx = {job.RUN_DIR: str(self.run.run_dir), job.PREEMPT_FLAG: str(self.flag), job.REQUEUE_FILE: str(self.asked),
                job.RESTART: str(self.restart), job.INCARNATION: self.incarnation}
        return child_env(os.environ, ranks, {**TORCHRUN_DEFAULTS, **self.run.site.nccl}, self.run.spec.env.set, hpcx, launch.cpus_per_task,
                         launch.gpus_per_node > 0)

    def error_file(self, rank: int) -> Path:
        """Where torch's ``@record`` writes the command's exception on ``rank`` (``TORCHELASTIC_ERROR_FILE``)."""
        return self.requeue_dir / f"{self.incarnation}.error-rank-{rank}.json"

    def _run_command(self) -> int:
        argv = self.argv()
        ignored = preempt_signal().name.removeprefix("SIG")
        # the preemption signal ignored across the exec (an ignored signal stays ignored), nothing else changed
        starter = ["/bin/sh", "-c", f'trap "" {ignored}; exec "$@"', "hpcx-command", *argv]
        try:
            self.child = subprocess.Popen(starter, cwd=self.workdir, env=self.environment(), stdin=subprocess.DEVNULL)
        except OSError as exc:  # the folder is gone: the rank reports it like any failure
            print(f"hpcx: cannot start {argv[0]!r} in {self.workdir}: {exc}", file=sys.stderr, flush=True)
            return 127
        while True:
            try:
                return self.child.wait()
            except InterruptedError:  # pragma: no cover - PEP 475 retries wait() after a handler
                continue

    # ------------------------------------------------------------ signals

    @property
    def terminated(self) -> bool:
        return self.stop.terminated

    @property
    def preempted_at(self) -> float | None:
        return self.stop.requested_at

    def _touch_flag(self) -> None:
        try:
            self.flag.touch()
        except OSError:  # the signal is still forwarded
            pass

    def _forward(self, signum: int) -> None:
        if self.child is not None and self.child.poll() is None:
            try:
                self.child.send_signal(signum)
            except OSError:
                pass

    # ------------------------------------------------------------ records

    def _record_start(self) -> None:
        ledger, side, run_dir = self.rd.read_ledger(), self.side, self.run.run_dir
        wait = side.queue_wait(run_dir, ledger) if side else wait_since_last_stop(run_dir, ledger)
        line = policy.start_line(self._step(), self.restart, side, "script", wait, command=list(self.command))
        append_jsonl(self.rd.ledger, {**line, "time": self.clock()})
        policy.record_start(run_dir, side)

    def _step(self) -> int:
        """The script's progress: the step of its newest ``hpc.job.log`` line (0 before any)."""
        last = self.rd.last_metrics() or {}
        step = last.get("step")
        return step if isinstance(step, int) else 0

    def _ended(self, status: int) -> dict[str, tp.Any] | None:
        """How the command ended on this rank, recorded (``RUN/requeue/INC.rank-R.ended``; a failure is also
        reported); rank 0 then waits for every rank's and decides. The result on rank 0 (None elsewhere);
        a command that failed here raises, so that the scheduler sees the task fail."""
        failed = status != 0 and not self.terminated
        error = f"job.command {exit_words(status)} on rank {self.env.rank}: {' '.join(self.command)}"
        error += recorded_error(self.error_file(self.env.rank)) if failed else ""
        if failed:
            policy.report_failure(self.run.run_dir, self.incarnation, self.env.rank, step=self._step(), error=error,
                                  phase="script", exit_status=status)
        write_json(self._ended_path(self.env.rank), {"rank": self.env.rank, "status": status, "time": self.exited_at,
                                                     "terminated": self.terminated, "error": error if failed else None})
        outside = self.side is not None and self.side.decides_failures
        result = self._decide(status) if self.env.is_rank0 and not (failed and outside) else None
        if failed:
            raise RuntimeError(error)
        return result

    def _ended_path(self, rank: int) -> Path:
        return self.requeue_dir / f"{self.incarnation}.rank-{rank}.ended"

    def _await_ranks(self, poll_s: float = 0.2) -> list[dict] | None:
        """Every rank's account of its command (rank 0, after its own ended); None when SIGTERM came
        meanwhile (the scheduler ends the job, or, on Slurm, the step after a task failed). A rank that never
        says (its task was killed outright) is waited for ``RANKS_WAIT_S``: then it counts as failed."""
        deadline = time.monotonic() + RANKS_WAIT_S
        while True:
            found = {r: self._ended_path(r) for r in range(self.env.world_size)}
            ready = {r: p for r, p in found.items() if p.exists()}
            if len(ready) == len(found):
                return [read_json(p) for _, p in sorted(ready.items())]
            if self.terminated and self.env.world_size > 1:
                return None
            if time.monotonic() > deadline:
                missing = sorted(set(found) - set(ready))
                return [read_json(p) for p in ready.values()] + [
                    {"rank": r, "status": None, "terminated": False,
                     "error": f"rank {r} never said how its command ended"}
                    for r in missing]
            time.sleep(poll_s)

    def _decide(self, status: int) -> dict[str, tp.Any]:
        """Rank 0, once every rank's command ended: the stop line, and the one requeue asked or allowed."""
        step, command = self._step(), list(self.command)
        ranks = self._await_ranks()
        ended_by = self.side.ended_by() if self.terminated and self.side is not None else None
        failures = first_failures(ranks or [])
        outside = self.side is not None and self.side.decides_failures
        if ended_by == "step" or (failures and outside):  # srun's step failed: the check after srun records it
            return {"reason": "failed", "requeued": False, "step": step, "command": command, "status": status}
        asked = self.asked.exists()
        requeue_reason: str | None
        if failures:
            reason, requeue_reason = "failed", "failed"
        elif self.terminated:
            reason, requeue_reason = ("time_limit", None) if ended_by == "time_limit" else ("terminated", None)
        elif asked:
            reason, requeue_reason = "preempted", "preempted"
        else:
            reason, requeue_reason = ("preempted", None) if self.preempted_at is not None else ("completed", None)
        why_not = {"terminated": TERMINATED, "time_limit": TIME_LIMIT}.get(reason)
        if reason == "preempted" and requeue_reason is None:
            why_not = SCRIPT_NOT_ASKED
        if requeue_reason is not None:
            why_not = policy.ask(self.side, self.run.run_dir, self.incarnation, requeue_reason, step,
                                 self.run.spec.job.max_requeues)
        extra = {"error": failures[0]["error"], "failed_ranks": [failures[0].get("rank")],
                 "reported_ranks": sorted(int(r.get("rank") or 0) for r in failures)} if failures else {}
        self._write_stop(step, reason, why_not, command_status=status, **extra)
        if requeue_reason is not None and why_not is None and self.side is not None:
            self.side.leave_for_requeue()
        if failures:  # not requeued: rank 0's task fails too, so the job does not look completed
            raise RuntimeError(failures[0]["error"])
        return self._summary({"reason": reason, "requeued": requeue_reason is not None and why_not is None,
                              "step": step, "command": command, "status": status})

    def _summary(self, ended: dict[str, tp.Any]) -> dict[str, tp.Any]:
        """The result on rank 0: how the command ended, and the trainer's summary keys (``steps``, the
        losses this start logged with ``hpc.job.log``, ranks; ``strategy`` "script") so that ``hpcx submit
        --wait`` prints the same line for a script as for the trainer (``hpc.cli.format_result``)."""
        lines = read_jsonl(self.rd.metrics) if self.rd.metrics.exists() else []
        losses = [r["loss"] for r in lines if r.get("start") == self.restart and isinstance(r.get("loss"), (int, float))]
        reason = ended["reason"]
        return {**ended, "steps": ended["step"], "final_loss": losses[-1] if losses else None, "losses": losses,
                "tokens_per_s": None, "world_size": self.env.world_size, "strategy": "script",
                "preempted": reason == "preempted", "cancelled": reason == "terminated",
                "time_limit": reason == "time_limit", "run_dir": str(self.run.run_dir)}

    def _write_stop(self, step: int, reason: str, why_not: str | None, **extra: tp.Any) -> None:
        line = policy.stop_line(step, reason, why_not, self.side, "rank 0", **extra)
        if self.preempted_at is not None:
            line["preempt_signal_at"] = self.preempted_at
        append_jsonl(self.rd.ledger, line)


def first_failures(ended: tp.Sequence[dict]) -> list[dict]:
    """The ranks' accounts of a failed command (``.ended`` records with an error), the first to end first:
    a peer whose command only failed because that one went away (a broken collective) ended later. Accounts
    without a time (a rank that never said) come last, by rank."""
    failed = [r for r in ended if r.get("error")]
    return sorted(failed, key=lambda r: (not isinstance(r.get("time"), (int, float)), r.get("time") or 0.0,
                                         r.get("rank") if isinstance(r.get("rank"), int) else 1 << 30))


def recorded_error(path: Path) -> str:
    """`` (ValueError: … at train.py:12)``: the exception torch's ``@record`` wrote for this rank
    (``TORCHELASTIC_ERROR_FILE``), with the innermost file and line of its traceback; "" when none."""
    try:
        message = json.loads(path.read_text())["message"]
        words, stack = str(message["message"]).splitlines()[0], str(message["extraInfo"]["py_callstack"])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return ""
    frames = re.findall(r'File "([^"]+)", line (\d+)', stack)
    where = f" at {frames[-1][0]}:{frames[-1][1]}" if frames else ""
    return f" ({words[:200]}{where})"


def describe(command: tp.Sequence[str]) -> str:
    """The command for people (render, status): its words as a JSON list."""
    return json.dumps(list(command))
